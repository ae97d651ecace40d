"""A network model that turns the byte log into communication time.

Every worker has one outgoing link of ``bandwidth`` (its egress; what arrives is not limited) and
every operation is ``hops`` sequential all-to-all steps (an exchange one, the communicator's
all-reduce two: reduce-scatter and all-gather, which carry equal halves of its bytes). A step
takes one ``latency`` plus the time the links need to carry its flows, computed as a fluid:

* **Wire bytes.** A payload of ``n`` B crosses the link as ``ceil(n / MSS)`` TCP segments, each
  with ``FRAME_HEADERS`` B of Ethernet, IPv4 and TCP headers (4.6 % more for full segments), and
  the receiver sends one ``ACK_FRAME`` for every ``SEGMENTS_PER_ACK`` segments over its own link
  (2.2 % of what it receives). Measured through a tbf-shaped veth: 1.046 B on the link per payload
  byte, and 0.023 B of ACKs back.
* **Fair sharing.** The flows a link carries at a time share it equally (its worker's ACKs are
  one more flow on it); when a flow ends, the others speed up. So a link whose flows cannot all
  start at once is not busy all the time.
* **gloo's pair ordering.** ``gloo::alltoallv`` posts, for i = 1..K-1, a send to rank r+i and then
  a receive from rank r-i, and a send only starts once the receiver's "ready to receive" message
  arrived. That message travels on the same TCP connection as the receiver's own data to the
  sender: if the receiver's send to that peer was posted before its receive from it and the
  peer's ready message was already there, its whole payload is in the connection first, and the
  peer's send waits until it has arrived. For a pair (a, b) where b posts later and a = b + e
  (mod K), b's data to a goes first and a's to b waits whenever 2e <= K: the pair at distance K/2
  always, every other pair for one of its two orders. Measured over two shaped links (3 MB each
  way): 2.1 x the one-way time instead of 1.08 x with plain sockets; a 4-rank all-to-all 1.3-1.6 x
  bytes/bandwidth, 1.1 x when every receive is posted before any send. The order in which the
  ranks post an operation is not in the log, so a step's time is averaged over all K! orders
  (``MAX_ORDERS`` of them, drawn with a fixed seed, when K! is larger). A transport that posted
  every receive before its sends would not wait, and this term would go.

Not modelled: TCP's congestion control (with BBR, a link whose other flows ended takes a few
round trips to fill again: measured 5-10 % above the wire time when nothing waits), and the
round trip of the ready messages. Ranks are the log's ``src``/``dst``.

The time of an operation is the latency plus the time until its last flow ended; a worker's time
in it, the latency plus the time until its own last flow ended.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

MSS = 1448  # B of TCP payload per segment: MTU 1500 - 20 (IPv4) - 20 (TCP) - 12 (timestamp option)
FRAME_HEADERS = 66  # B of headers per segment on the link: 14 (Ethernet) + 20 (IPv4) + 32 (TCP with timestamps)
ACK_FRAME = 66  # B of a pure ACK on the link
SEGMENTS_PER_ACK = 2  # delayed ACKs: one per two full segments
ACK_SHARE = ACK_FRAME / (SEGMENTS_PER_ACK * (MSS + FRAME_HEADERS))  # B of ACKs per B of data received
MAX_ORDERS = 24  # posting orders averaged over per step (all of them up to K = 4)

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
        ``simulated_seconds`` adds the headers, the ACKs and gloo's pair ordering."""
        return hops * self.latency_ms / 1000.0 + nbytes * 8 / (self.bandwidth_mbps * 1e6)


def wire_bytes(payload: float) -> float:
    """B a payload of ``payload`` B occupies on its sender's link: the payload and the headers of
    its TCP segments (0 for an empty payload)."""
    return payload + math.ceil(payload / MSS) * FRAME_HEADERS


def _orders(world: int) -> list[tuple[int, ...]]:
    """The posting orders a step is averaged over (rank posting first, second, ...)."""
    if math.factorial(world) <= MAX_ORDERS:
        return list(itertools.permutations(range(world)))
    rng = random.Random(0)
    return [tuple(rng.sample(range(world), world)) for _ in range(MAX_ORDERS)]


def _waits(flows: dict[Flow, float], order: tuple[int, ...]) -> dict[Flow, Flow]:
    """Flow -> the reverse flow of its pair it waits for, when the ranks post in ``order``."""
    world, position = len(order), {rank: i for i, rank in enumerate(order)}
    waits: dict[Flow, Flow] = {}
    for a, b in flows:
        later, earlier = (a, b) if position[a] > position[b] else (b, a)
        if a < b and (b, a) in flows and 2 * ((earlier - later) % world) <= world:
            waits[(earlier, later)] = (later, earlier)
    return waits


def _finish_times(flows: dict[Flow, float], world: int, waits: dict[Flow, Flow]) -> dict[int, float]:
    """Link (= sending worker) -> when the last flow on it ended, in B at link capacity.

    ``flows``: wire bytes per flow; a flow in ``waits`` starts when the flow it waits for ended,
    the others at 0. Every link serves its started flows in processor sharing (each at 1/n of
    the capacity while n are under way) plus one flow of its worker's ACKs (``ACK_SHARE`` of the
    wire bytes it receives) from 0. Event by event, with each link's service per flow so far
    (``served``) as its clock.
    """
    sizes = [(src, nbytes) for (src, _), nbytes in flows.items() if nbytes > 0]
    index = {flow: i for i, flow in enumerate(f for f, b in flows.items() if b > 0)}
    received = [0.0] * world
    for (_, dst), nbytes in flows.items():
        received[dst] += nbytes
    sizes += [(rank, ACK_SHARE * nbytes) for rank, nbytes in enumerate(received) if nbytes > 0]
    waiting: dict[int, list[int]] = {}
    for flow, first in waits.items():
        if flow in index and first in index:
            waiting.setdefault(index[first], []).append(index[flow])
    queued = {i for later in waiting.values() for i in later}
    served, count = [0.0] * world, [0] * world
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(world)]
    tolerance = 1e-9 * max((b for _, b in sizes), default=0.0)

    def begin(i: int) -> None:
        link, nbytes = sizes[i]
        heapq.heappush(heaps[link], (served[link] + nbytes, i))
        count[link] += 1

    for i in range(len(sizes)):
        if i not in queued:
            begin(i)
    now, finish = 0.0, {}
    while any(heaps):
        now_step = min((heap[0][0] - served[link]) * count[link] for link, heap in enumerate(heaps) if heap)
        now += now_step
        for link in range(world):
            if count[link]:
                served[link] += now_step / count[link]
        for link, heap in enumerate(heaps):
            while heap and heap[0][0] <= served[link] + tolerance:
                _, i = heapq.heappop(heap)
                count[link] -= 1
                finish[link] = now
                for later in waiting.pop(i, []):
                    begin(later)
    return finish


def _step_seconds(flows: dict[Flow, float], world: int, seconds_per_byte: float) -> tuple[float, dict[int, float]]:
    """(time until the last flow ended, time until each sender's last flow ended), in s, of one
    all-to-all step carrying ``flows`` (wire bytes), averaged over the posting orders."""
    orders = _orders(world)
    makespan, per_sender = 0.0, dict.fromkeys({src for src, _ in flows}, 0.0)
    cache: dict[frozenset[tuple[Flow, Flow]], dict[int, float]] = {}
    for order in orders:
        waits = _waits(flows, order)
        key = frozenset(waits.items())
        if key not in cache:
            cache[key] = _finish_times(flows, world, waits)
        finish = cache[key]
        makespan += max(finish.values(), default=0.0)
        for src, t in finish.items():
            per_sender[src] = per_sender.get(src, 0.0) + t
    scale = seconds_per_byte / len(orders)
    return makespan * scale, {src: t * scale for src, t in per_sender.items()}


def simulated_seconds(log: pa.Table, network: NetworkModel) -> tuple[float, dict[int, float]]:
    """(run time in s, time in s per sending worker) of the operations in a comm log table.

    Operations are identified by ``(layer, op)`` and are synchronous across workers, so the run
    time is the sum over operations of the time until the operation's last flow ended; a worker's,
    the sum of the times until its own last flow ended (see the module docstring).
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
    world = 1 + max(max(pc.max(log.column("src")).as_py(), pc.max(log.column("dst")).as_py()), 0)
    seconds_per_byte = 8 / (network.bandwidth_mbps * 1e6)
    latency = network.latency_ms / 1000.0
    total, per_worker = 0.0, {}
    steps: dict[tuple[tuple[Flow, float], ...], tuple[float, dict[int, float]]] = {}
    for flows, hops in ops.values():
        step_flows = tuple(sorted((f, wire_bytes(b / hops)) for f, b in flows.items()))
        if step_flows not in steps:
            steps[step_flows] = _step_seconds(dict(step_flows), world, seconds_per_byte)
        makespan, per_sender = steps[step_flows]
        total += hops * (latency + makespan)
        for src in {s for s, _ in flows}:
            per_worker[src] = per_worker.get(src, 0.0) + hops * (latency + per_sender.get(src, 0.0))
    return float(total), per_worker


def bytes_by_kind(log: pa.Table) -> dict[str, int]:
    if log.num_rows == 0:
        return {}
    grouped = log.group_by("kind").aggregate([("bytes", "sum")])
    return dict(zip(grouped.column("kind").to_pylist(), grouped.column("bytes_sum").to_pylist()))


def total_bytes(log: pa.Table) -> int:
    return int(pc.sum(log.column("bytes")).as_py() or 0) if log.num_rows else 0
