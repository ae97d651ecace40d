"""A simple network model that turns the byte log into communication time.

Each operation takes ``hops * latency + max_worker_bytes / bandwidth``: workers send in parallel,
each over its own link of ``bandwidth``; a ring all-reduce has 2(K-1) sequential hops, an
all-to-all exchange one.
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field


class NetworkModel(BaseModel):
    """Latency (ms) and bandwidth (Mbit/s) of every worker's link; ``sleep`` really waits."""

    latency_ms: float = Field(10.0, ge=0, description="Network model: latency per message step (ms).")
    bandwidth_mbps: float = Field(100.0, gt=0, description="Network model: link bandwidth (Mbit/s).")
    mode: Literal["simulate", "sleep"] = Field("simulate", description="simulate (compute time from the log) or "
                                               "sleep (really wait).", json_schema_extra={"cli": "net-mode"})

    def seconds(self, hops: int, nbytes: int) -> float:
        """Time of one operation in which the busiest worker sends ``nbytes`` over ``hops`` steps."""
        return hops * self.latency_ms / 1000.0 + nbytes * 8 / (self.bandwidth_mbps * 1e6)


def simulated_seconds(log: pa.Table, network: NetworkModel) -> tuple[float, dict[int, float]]:
    """(run time, time per sending worker) of the operations in a comm log table.

    Operations are identified by ``(layer, op)`` and are synchronous across workers, so the run
    time is the sum over operations of the slowest worker's time.
    """
    if log.num_rows == 0:
        return 0.0, {}
    per_worker_op = log.group_by(["layer", "op", "src"]).aggregate([("bytes", "sum"), ("hops", "max")])
    per_worker: dict[int, float] = {}
    per_op: dict[tuple[int, int], float] = {}
    for layer, op, src, nbytes, hops in zip(
        *(per_worker_op.column(c).to_pylist() for c in ("layer", "op", "src", "bytes_sum", "hops_max"))
    ):
        t = network.seconds(hops, nbytes)
        per_worker[src] = per_worker.get(src, 0.0) + t
        per_op[(layer, op)] = max(per_op.get((layer, op), 0.0), t)
    return float(sum(per_op.values())), per_worker


def bytes_by_kind(log: pa.Table) -> dict[str, int]:
    if log.num_rows == 0:
        return {}
    grouped = log.group_by("kind").aggregate([("bytes", "sum")])
    return dict(zip(grouped.column("kind").to_pylist(), grouped.column("bytes_sum").to_pylist()))


def total_bytes(log: pa.Table) -> int:
    return int(pc.sum(log.column("bytes")).as_py() or 0) if log.num_rows else 0
