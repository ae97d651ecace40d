"""Node-to-partition assignment methods: random, METIS (pymetis), supernode (SuperTMA), column."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

METIS_OBJECTIVE = {"cut": 0, "vol": 1}  # METIS_OBJTYPE_CUT, METIS_OBJTYPE_VOL
PREVIOUS = "previous"  # stable_from: the newest matching partition of the dataset's previous version


class PartitionOptions(BaseModel):
    """How to partition (the fields that affect the result are part of the partition fingerprint).

    Attributes:
        method: ``random`` (balanced, seeded), ``metis`` (pymetis k-way), ``supernode`` (METIS into
            ``clusters`` small clusters, clusters dealt to partitions at random: SuperTMA), or
            ``column`` (the dataset's node column ``column`` names each node's partition).
        parts: number of partitions K (for ``column``: must equal the number of distinct values).
        objective: METIS objective, ``cut`` (edge cut) or ``vol`` (communication volume).
        clusters: supernode cluster count (default ``max(16 * parts, parts)``).
        stable_from: anchor partition (fingerprint or unique prefix, or ``previous``): nodes it
            assigns keep their part, new nodes are placed around them (``graphstore.partition.stable``).
            Resolved to a full fingerprint (or None) by ``graphstore.lookup.resolve_stable_from``
            before fingerprinting; only a resolved anchor enters the fingerprint.
    """

    method: Literal["random", "metis", "supernode", "column"] = Field(
        "metis", description="random | metis | supernode | column.")
    parts: int = Field(4, ge=1, description="Number of partitions K (= workers).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed (random assignment, METIS, supernode dealing), "
                      "0 to 2^32-1 (METIS takes at most 2^63-1).")
    objective: Literal["cut", "vol"] = Field(
        "cut", description="METIS objective: cut (edge cut) or vol (communication volume).")
    clusters: int | None = Field(None, ge=1, description="supernode: number of METIS clusters (default 16 x parts).")
    column: str | None = Field(None, description="column: node column holding each node's partition.")
    stable_from: str | None = Field(
        None,
        description="Keep the parts of an earlier partition: its fingerprint (or a unique prefix), or 'previous' "
                    "(the newest partition with the same method and parts of the previous version of this dataset). "
                    "Nodes it assigns keep their part; new nodes are placed by the method without moving old ones.",
    )

    @field_validator("stable_from")
    @classmethod
    def _anchor(cls, value: str | None) -> str | None:
        """Blank means no anchor; fingerprints are matched as written (hex, lower case)."""
        value = value.strip() if value is not None else None
        return value or None

    @model_validator(mode="after")
    def _consistent(self) -> "PartitionOptions":
        if self.method == "column" and not self.column:
            raise ValueError("method 'column' needs the name of the node column (column=...)")
        if self.method == "supernode" and self.clusters is not None and self.clusters < self.parts:
            raise ValueError(f"supernode needs at least as many clusters ({self.clusters}) as parts ({self.parts})")
        return self

    def fingerprint_payload(self) -> dict[str, object]:
        """Only the options that affect the result of this method."""
        payload: dict[str, object] = {"method": self.method, "parts": self.parts}
        if self.method in ("random", "metis", "supernode"):
            payload["seed"] = self.seed
        if self.method in ("metis", "supernode"):
            payload["objective"] = self.objective
        if self.method == "supernode":
            payload["clusters"] = self.supernode_clusters
        if self.method == "column":
            payload["column"] = self.column
        if self.stable_from is not None:  # absent otherwise: fingerprints of unanchored partitions unchanged
            payload["stable_from"] = self.stable_from
        return payload

    @property
    def supernode_clusters(self) -> int:
        return self.clusters or 16 * self.parts


def metis_adjacency(num_nodes: int, src: np.ndarray, dst: np.ndarray, symmetric_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
    """CSR (xadj (N+1,), adjncy (2M,)) of the undirected simple graph METIS needs.

    ``src``/``dst`` are row positions 0..N-1. When the edges are already symmetric, deduplicated
    and sorted by (src, dst) (the store guarantees the last two; the manifest records the first),
    only self loops are dropped; otherwise edges are symmetrised and deduplicated first.
    """
    if symmetric_sorted:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    else:
        n = np.int64(num_nodes)
        keys = np.concatenate([src * n + dst, dst * n + src])
        keys = np.unique(keys)
        src, dst = np.divmod(keys, n)
        keep = src != dst
        src, dst = src[keep], dst[keep]
    xadj = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=num_nodes), out=xadj[1:])
    return xadj, dst.astype(np.int64, copy=False)


def metis_parts(xadj: np.ndarray, adjncy: np.ndarray, parts: int, seed: int, objective: str) -> np.ndarray:
    """(N,) int64 partition of each node by pymetis k-way with the given seed and objective.
    pymetis is imported here, by METIS partitionings alone: the modules that only read partition
    options (lookups, plans, the workers) never load it."""
    import pymetis

    num_nodes = len(xadj) - 1
    if parts == 1:
        return np.zeros(num_nodes, np.int64)
    options = pymetis.Options(seed=seed, objtype=METIS_OBJECTIVE[objective])
    _cut, membership = pymetis.part_graph(
        parts, adjacency=pymetis.CSRAdjacency(xadj, adjncy), recursive=False, options=options
    )
    return np.asarray(membership, dtype=np.int64)


def random_parts(num_nodes: int, parts: int, seed: int) -> np.ndarray:
    """Balanced random assignment: a seeded permutation dealt round-robin (sizes differ by <= 1)."""
    part = np.empty(num_nodes, np.int64)
    part[np.random.default_rng(seed).permutation(num_nodes)] = np.arange(num_nodes) % parts
    return part


def supernode_parts(xadj: np.ndarray, adjncy: np.ndarray, parts: int, clusters: int, seed: int, objective: str) -> np.ndarray:
    """SuperTMA: METIS into ``clusters`` clusters, clusters dealt to partitions at random, balanced."""
    cluster = metis_parts(xadj, adjncy, clusters, seed, objective)
    cluster_part = random_parts(clusters, parts, seed)
    return cluster_part[cluster]


def column_parts(values: np.ndarray, parts: int, column: str) -> np.ndarray:
    """Partition ids from a node column: integers 0..K-1 as given, other values mapped in sorted order."""
    distinct, codes = np.unique(values, return_inverse=True)
    if len(distinct) != parts:
        raise ValueError(
            f"column '{column}' has {len(distinct)} distinct values ({', '.join(map(str, distinct[:10]))}), "
            f"but {parts} parts were asked for"
        )
    if np.issubdtype(values.dtype, np.integer) and distinct.min() >= 0 and distinct.max() < parts:
        return values.astype(np.int64)
    return codes.astype(np.int64)
