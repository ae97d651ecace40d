"""A network model that turns the byte log into communication time.

Every worker has one outgoing link of ``bandwidth`` (its egress; what arrives is not limited) and
every operation is ``hops`` sequential all-to-all steps (an exchange one, the communicator's
all-reduce two: reduce-scatter and all-gather, which carry equal halves of its bytes). A step
takes one ``latency`` plus the time its busiest link needs for the step's bytes on the wire:

* **Wire bytes.** A payload of ``n`` B crosses the link as ``ceil(n / MSS)`` TCP segments, each
  with ``FRAME_HEADERS`` B of Ethernet, IPv4 and TCP headers (4.6 % more for full segments), and
  the receiver sends one ``ACK_FRAME`` for every ``SEGMENTS_PER_ACK`` segments over its own link
  (2.2 % of what it receives). Measured through a tbf-shaped veth: 1.046 B on the link per payload
  byte, and 0.023 B of ACKs back.
* **Parallel links, busy throughout.** A worker's flows to its peers share its link and all
  start at once, since the gloo transport posts every receive before any send
  (``retexo_core.comm.transport.GlooTransport``), so a link is busy until it has sent its last
  byte. (gloo's own alltoallv posts each send before the matching receive, and a send starts only
  when the receiver's "ready" message has arrived, behind the receiver's own data on the same TCP
  connection: one direction of some pairs then waited for the other, measured 1.3-1.6x bytes /
  bandwidth for 4 shaped sites, 1.1x with receives first.)

Not modelled: TCP's congestion control (a link whose other flows ended takes a few round trips to
fill again: measured 5-10 % above the wire time), and the round trip of the ready messages.
Ranks are the log's ``src``/``dst``.
"""

from __future__ import annotations

import math
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

MSS = 1448  # B of TCP payload per segment: MTU 1500 - 20 (IPv4) - 20 (TCP) - 12 (timestamp option)
FRAME_HEADERS = 66  # B of headers per segment on the link: 14 (Ethernet) + 20 (IPv4) + 32 (TCP with timestamps)
ACK_FRAME = 66  # B of a pure ACK on the link
SEGMENTS_PER_ACK = 2  # delayed ACKs: one per two full segments
ACK_SHARE = ACK_FRAME / (SEGMENTS_PER_ACK * (MSS + FRAME_HEADERS))  # B of ACKs per B of data received

Flow = tuple[int, int]  # (src, dst)


class NetworkModel(BaseModel):
    """Latency (ms) and bandwidth (Mbit/s) of every worker's link; ``sleep`` really waits."""

    latency_ms: float = Field(10.0, ge=0, description="Network model: latency per message step (ms).")
    bandwidth_mbps: float = Field(100.0, gt=0, description="Network model: link bandwidth (Mbit/s).")
    mode: Literal["simulate", "sleep"] = Field("simulate", description="simulate (compute time from the log) or "
                                               "sleep (really wait).", json_schema_extra={"cli": "net-mode"})

    def seconds(self, hops: int, nbytes: int) -> float:
        """Idealised time (s) of one operation in which the busiest worker sends ``nbytes`` B of
        payload over ``hops`` steps, its link busy throughout and no headers (what ``sleep`` waits).
        ``simulated_seconds`` adds the headers and the ACKs."""
        return hops * self.latency_ms / 1000.0 + nbytes * 8 / (self.bandwidth_mbps * 1e6)


def wire_bytes(payload: float) -> float:
    """B a payload of ``payload`` B occupies on its sender's link: the payload and the headers of
    its TCP segments (0 for an empty payload)."""
    return payload + math.ceil(payload / MSS) * FRAME_HEADERS


def link_loads(flows: dict[Flow, float]) -> dict[int, float]:
    """Link (= worker) -> B it carries in one step of ``flows`` (payload B per (src, dst)): the
    wire bytes of what the worker sends and the ACKs of what it receives."""
    load: dict[int, float] = {}
    for (src, dst), payload in flows.items():
        wire = wire_bytes(payload)
        load[src] = load.get(src, 0.0) + wire
        load[dst] = load.get(dst, 0.0) + ACK_SHARE * wire
    return load


def simulated_seconds(log: pa.Table, network: NetworkModel) -> tuple[float, dict[int, float]]:
    """(run time in s, time in s per sending worker) of the operations in a comm log table.

    Operations are identified by ``(layer, op)`` and are synchronous across workers, so the run
    time is the sum over operations of the busiest link's time; a worker's, the sum of its own
    link's times (see the module docstring).
    """
    if log.num_rows == 0:
        return 0.0, {}
    grouped = log.group_by(["layer", "op", "src", "dst"]).aggregate([("bytes", "sum"), ("hops", "max")])
    ops: dict[tuple[int, int], tuple[dict[Flow, int], int]] = {}
    for layer, op, src, dst, nbytes, hops in zip(
        *(grouped.column(c).to_pylist() for c in ("layer", "op", "src", "dst", "bytes_sum", "hops_max"))
    ):
        flows, most = ops.get((layer, op), ({}, 1))
        flows[(src, dst)] = nbytes
        ops[(layer, op)] = (flows, max(most, hops))
    seconds_per_byte = 8 / (network.bandwidth_mbps * 1e6)
    latency = network.latency_ms / 1000.0
    total, per_worker = 0.0, {}
    for flows, hops in ops.values():
        load = link_loads({f: b / hops for f, b in flows.items()})
        total += hops * (latency + max(load.values()) * seconds_per_byte)
        for src in {s for s, _ in flows}:
            per_worker[src] = per_worker.get(src, 0.0) + hops * (latency + load[src] * seconds_per_byte)
    return float(total), per_worker


def bytes_by_kind(log: pa.Table) -> dict[str, int]:
    if log.num_rows == 0:
        return {}
    grouped = log.group_by("kind").aggregate([("bytes", "sum")])
    return dict(zip(grouped.column("kind").to_pylist(), grouped.column("bytes_sum").to_pylist()))


def total_bytes(log: pa.Table) -> int:
    return int(pc.sum(log.column("bytes")).as_py() or 0) if log.num_rows else 0
