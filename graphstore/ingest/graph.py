"""The in-memory graph every loader produces before validation and writing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import scipy.sparse


@dataclass
class SourceGraph:
    """A node-classification graph as read from a source, before it is written.

    Attributes:
        node_id: (N,) int64 node ids, any order, must be unique.
        label: (N,) int64 class per node, -1 for unknown.
        split: (N,) str ``train|val|test|none``, or None to draw a stratified split.
        x: (N, F) float32 features, row i belongs to ``node_id[i]``: an ndarray, or a
            ``scipy.sparse.csr_matrix`` for sources that are sparse (Planetoid, JSON active ids),
            never densified on the way in (``graphstore.ingest.features`` picks the stored layout).
        src, dst: (E,) int64 directed edges, node ids (not row positions), in source order
            (so validation errors name the source's rows).
        undirected: store every edge in both directions (reverse edges are added when writing).
        remote_sources: a site's graph: an edge's source may be a node another site holds (not
            in ``node_id``); only edges into this site's nodes are stored (an undirected edge
            from a remote node is stored in the direction that ends here).
        edge_columns: the source's names of the edge columns, used in error messages.
        extra: further node columns kept from the source (e.g. a site assignment), (N,) each.
        num_classes: number of classes; labels must lie in ``[0, num_classes)`` or be -1.
        files: which file each part came from, used in error messages
            (keys ``nodes``, ``edges``, ``features``).
    """

    node_id: np.ndarray
    label: np.ndarray
    split: np.ndarray | None
    x: np.ndarray | scipy.sparse.csr_matrix
    src: np.ndarray
    dst: np.ndarray
    num_classes: int
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    undirected: bool = False
    edge_columns: tuple[str, str] = ("src", "dst")
    remote_sources: bool = False

    @property
    def num_nodes(self) -> int:
        return int(self.node_id.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    def stored_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) to write: the source's edges, plus their reverses when ``undirected``."""
        src, dst = self.src, self.dst
        if self.undirected:
            src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
        if self.remote_sources:
            known = np.sort(self.node_id)
            pos = np.searchsorted(known, dst).clip(0, len(known) - 1)
            into_site = known[pos] == dst
            src, dst = src[into_site], dst[into_site]
        return src, dst
