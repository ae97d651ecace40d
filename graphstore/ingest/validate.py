"""Checks run on a loaded graph before anything is written; each failure names file, column, row.

Rows are reported 1-based, counting data rows (the first row after a CSV header is row 1).
"""

from __future__ import annotations

import numpy as np

from graphstore.errors import InputError
from graphstore.ingest.graph import SourceGraph
from graphstore.parquet_io import SPLITS


def first_true(mask: np.ndarray) -> int:
    """Index of the first True in a boolean array (caller guarantees there is one)."""
    return int(np.argmax(mask))


def check_unique_ids(node_id: np.ndarray, file: str, column: str = "node_id") -> None:
    """Refuse repeated ids, reporting the first row whose id already appeared in an earlier row."""
    _values, first_row, inverse = np.unique(node_id, return_index=True, return_inverse=True)
    repeated = first_row[inverse] != np.arange(len(node_id))
    if repeated.any():
        row = first_true(repeated)
        raise InputError(
            file, f"duplicate node id {node_id[row]} (also in row {first_row[inverse[row]] + 1})", column, row + 1
        )


def check_edges_known(graph: SourceGraph) -> None:
    """Refuse the first edge row whose source or target is not a node id.

    Edges are checked as the source gave them (before reverse edges are added for undirected
    graphs), so the row and column named are the edge file's. A site's graph (``remote_sources``)
    may name remote nodes as sources; its targets must be its own (both ends, if undirected:
    an edge between two remote nodes is not the site's).
    """
    known = np.sort(graph.node_id)
    unknown_rows = []
    checked = list(zip(graph.edge_columns, (graph.src, graph.dst)))
    if graph.remote_sources:
        checked = [(graph.edge_columns[1], graph.dst)]
        if graph.undirected:
            pos = np.searchsorted(known, graph.src).clip(0, len(known) - 1)
            checked = [(graph.edge_columns[1], np.where(known[pos] == graph.src, graph.src, graph.dst))]
    for column, values in checked:
        pos = np.searchsorted(known, values).clip(0, max(len(known) - 1, 0))
        unknown = known[pos] != values if len(known) else np.ones(len(values), bool)
        if unknown.any():
            unknown_rows.append((first_true(unknown), column, values))
    if unknown_rows:
        row, column, values = min(unknown_rows, key=lambda item: item[0])  # the earlier row; src first on a tie
        raise InputError(
            graph.files.get("edges", "edges"),
            f"edge refers to node {values[row]}, which is not in the nodes table ({graph.files.get('nodes', 'nodes')})"
            + (": a site's edges must end at its own nodes" if graph.remote_sources else ""),
            column,
            row + 1,
        )


def check_labels(graph: SourceGraph) -> None:
    file = graph.files.get("nodes", "nodes")
    bad = (graph.label < -1) | (graph.label >= graph.num_classes)
    if bad.any():
        row = first_true(bad)
        raise InputError(
            file,
            f"label {graph.label[row]} is out of range: expected -1 (unknown) or 0..{graph.num_classes - 1}",
            "label",
            row + 1,
        )


def check_splits(graph: SourceGraph) -> None:
    if graph.split is None:
        return
    file = graph.files.get("nodes", "nodes")
    bad = ~np.isin(graph.split, np.array(SPLITS))
    if bad.any():
        row = first_true(bad)
        raise InputError(file, f"split '{graph.split[row]}' is not one of {', '.join(SPLITS)}", "split", row + 1)
    unlabeled = (graph.split != "none") & (graph.label < 0)
    if unlabeled.any():
        row = first_true(unlabeled)
        raise InputError(file, f"node in split '{graph.split[row]}' has no label (-1)", "label", row + 1)


def check_features(graph: SourceGraph) -> None:
    """One feature row per node, width > 0, finite values; ``graph.x`` dense or CSR.

    For a CSR matrix only the stored entries are looked at (unstored entries are zeros), so
    nothing of size N x F is allocated.
    """
    file = graph.files.get("features", "features")
    x = graph.x
    if len(x.shape) != 2 or x.shape[0] != graph.num_nodes:
        raise InputError(file, f"expected one feature row per node ({graph.num_nodes}), got shape {x.shape}")
    if x.shape[1] == 0:
        raise InputError(file, "feature width is 0")
    if isinstance(x, np.ndarray):
        finite = np.isfinite(x)
        if not finite.all():
            row, col = np.argwhere(~finite)[0]
            raise InputError(file, f"feature value {x[row, col]} is not finite (feature {col})", "x", int(row) + 1)
        return
    finite = np.isfinite(x.data)
    if not finite.all():
        entry = first_true(~finite)
        row = int(np.searchsorted(x.indptr, entry, side="right")) - 1
        raise InputError(file, f"feature value {x.data[entry]} is not finite (feature {x.indices[entry]})", "x", row + 1)


def validate_graph(graph: SourceGraph) -> None:
    """All checks, in the order a user would fix them: ids, labels, splits, features, edges."""
    check_unique_ids(graph.node_id, graph.files.get("nodes", "nodes"))
    if graph.num_nodes == 0:
        raise InputError(graph.files.get("nodes", "nodes"), "the graph has no nodes")
    check_labels(graph)
    check_splits(graph)
    check_features(graph)
    check_edges_known(graph)
