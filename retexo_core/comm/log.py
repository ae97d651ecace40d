"""The communication log: one row per message (or per worker per collective), counted once."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

# Every kind of traffic between workers, in the order of byte tables and of a site's byte totals
# (the one declaration: the benchmarks' columns and the communicator's codecs derive from it).
KINDS = ("halo_features", "halo_embeddings", "halo_grads", "grad_sync", "model_sync", "control", "secure_agg",
         "link_rows", "halo_aggregates", "two_hop_rows")
# The kinds a ``--compression`` codec may encode: every kind but ``control`` (counts, ids, metrics,
# agreement) and ``secure_agg`` (pairwise seeds, and the excess of masked fixed-point sums), which
# are always sent raw.
COMPRESSIBLE = frozenset(KINDS) - {"control", "secure_agg"}

COMM_SCHEMA = pa.schema([
    ("op", pa.int64()),          # sequence number of the communication operation on this worker
    ("layer", pa.int64()),       # layer being trained (0 = whole model / not layer-specific)
    ("epoch", pa.int64()),       # round or epoch within the layer (-1 = setup / evaluation)
    ("kind", pa.string()),
    ("src", pa.int64()),         # sending rank
    ("dst", pa.int64()),         # receiving rank
    ("bytes", pa.int64()),       # payload bytes on the wire, after compression
    ("hops", pa.int64()),        # sequential message steps of the operation (latency count)
])


@dataclass
class CommLog:
    """Rows logged by one worker for what IT sends (so every byte is counted exactly once)."""

    rank: int
    rows: list[tuple[int, int, int, str, int, int, int, int]] = field(default_factory=list)
    next_op: int = 0
    sent: int = 0  # bytes of all rows so far

    def new_op(self) -> int:
        op = self.next_op
        self.next_op += 1
        return op

    def add(self, op: int, layer: int, epoch: int, kind: str, dst: int, nbytes: int, hops: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown traffic kind {kind!r}; expected one of {KINDS}")
        self.rows.append((op, layer, epoch, kind, self.rank, dst, int(nbytes), hops))
        self.sent += int(nbytes)

    def total_bytes(self) -> int:
        return self.sent

    def to_table(self) -> pa.Table:
        columns = list(zip(*self.rows)) if self.rows else [[] for _ in COMM_SCHEMA]
        return pa.table({f.name: pa.array(col, f.type) for f, col in zip(COMM_SCHEMA, columns)}, schema=COMM_SCHEMA)
