"""Writing a validated graph into ``datasets/name=<name>/fp=<fp>/``.

``features.parquet`` is written in the layout of the feature matrix it is given (dense ``x`` or
sparse ``x_idx``/``x_val``, ``graphstore.parquet_io``), recorded with the width in the manifest's
``feature_format`` and ``num_features``.

The folder is committed by ``graphstore.atomic.atomic_artefact``: the manifest records the sha256
of the three files, and a stored version that is corrupt (unreadable manifest, changed files) is
replaced by ingesting the same data again.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.atomic import atomic_artefact
from graphstore.fingerprint import fingerprint
from graphstore.ingest.graph import SourceGraph
from graphstore.layout import Store
from graphstore.lookup import DatasetRef
from graphstore.manifests import DatasetManifest
from graphstore.parquet_io import (
    COMPRESSION,
    DENSE_COLUMN,
    EDGE_SCHEMA,
    edges_table,
    feature_format_of,
    features_nonnegative,
    features_table_of,
)

DATASET_FORMAT = 2  # bump when the on-disk layout of a dataset changes (2: sparse feature layout)


def dataset_fingerprint(name: str, source_kind: str, options: dict[str, Any], content: dict[str, Any]) -> str:
    """Fingerprint of a dataset: name + source kind + ingest options + source content + format."""
    return fingerprint(
        {"format": DATASET_FORMAT, "name": name, "source": source_kind, "options": options, "content": content}
    )


def canonical_edges(node_id_sorted: np.ndarray, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Deduplicate and sort edges by (src, dst). Returns (src, dst, number of duplicates removed)."""
    n = np.int64(len(node_id_sorted))
    key = np.searchsorted(node_id_sorted, src).astype(np.int64) * n + np.searchsorted(node_id_sorted, dst)
    unique_key = np.unique(key)
    src_pos, dst_pos = np.divmod(unique_key, n)
    return node_id_sorted[src_pos], node_id_sorted[dst_pos], int(len(key) - len(unique_key))


def canonical_edges_by_id(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``canonical_edges`` for edges whose sources may be remote ids (a site's graph)."""
    order = np.lexsort((dst, src))
    src, dst = src[order], dst[order]
    keep = np.ones(len(src), bool)
    keep[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1])
    return src[keep], dst[keep], int(len(keep) - np.count_nonzero(keep))


def is_symmetric(node_id_sorted: np.ndarray, src: np.ndarray, dst: np.ndarray) -> bool:
    """True when every edge (u, v) has its reverse (v, u); edges must be deduplicated."""
    n = np.int64(len(node_id_sorted))
    s = np.searchsorted(node_id_sorted, src).astype(np.int64)
    d = np.searchsorted(node_id_sorted, dst).astype(np.int64)
    return bool(np.array_equal(np.sort(s * n + d), np.sort(d * n + s)))


def write_graph(store: Store, name: str, fp: str, graph: SourceGraph, source: dict[str, Any]) -> DatasetRef:
    """Write a validated graph: nodes sorted by id, edges deduplicated and sorted by (src, dst).

    ``graph.x`` is written as it is: an ndarray dense, a CSR matrix sparse (rows reordered, never
    densified).
    """
    order = np.argsort(graph.node_id, kind="stable")
    node_id = graph.node_id[order]
    columns: dict[str, Any] = {
        "node_id": pa.array(node_id, pa.int64()),
        "label": pa.array(graph.label[order], pa.int64()),
        "split": pa.array(graph.split[order], pa.string()),
    }
    for column, values in graph.extra.items():
        columns[column] = pa.array(values[order])
    nodes = pa.table(columns)
    if graph.remote_sources:
        src, dst, duplicates = canonical_edges_by_id(*graph.stored_edges())
    else:
        src, dst, duplicates = canonical_edges(node_id, *graph.stored_edges())
    features = features_table_of(node_id, graph.x[order])
    remote = np.setdiff1d(src, node_id)
    stats = {
        "duplicates_removed": duplicates,
        "remote_nodes": int(len(remote)),
        "symmetric": not len(remote) and is_symmetric(node_id, src, dst),
        "self_loops": int(np.count_nonzero(src == dst)),
    }
    return write_dataset_files(
        store, name, fp, nodes, [features], [(src, dst)], graph.num_classes, {"source": source, **stats},
        num_features=graph.num_features,
    )


def write_dataset_files(
    store: Store,
    name: str,
    fp: str,
    nodes: pa.Table,
    feature_chunks: Iterable[pa.Table],
    edge_chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    extra_manifest: dict[str, Any],
    num_features: int | None = None,
) -> DatasetRef:
    """Stream the three tables into a temp folder and commit it atomically with its manifest.

    ``feature_chunks`` must be in ``nodes`` order, all in one layout (``parquet_io``); the width
    is read from dense chunks and must be given as ``num_features`` for sparse ones.
    ``edge_chunks`` yield ``(src, dst)`` id arrays.
    """
    target = store.dataset_dir(name, fp)
    with atomic_artefact(store, target) as writer:
        pq.write_table(nodes, writer.path / "nodes.parquet", compression=COMPRESSION)
        feature_format, nonnegative = "dense", True
        with _ParquetStream(writer.path / "features.parquet") as features_out:
            for chunk in feature_chunks:
                features_out.write(chunk)
                nonnegative = nonnegative and features_nonnegative(chunk)
                feature_format = feature_format_of(chunk.column_names)
                if feature_format == "dense":
                    num_features = chunk.column(DENSE_COLUMN).type.list_size
        if num_features is None:
            raise ValueError("num_features must be given for sparse feature chunks (or when there are none)")
        num_edges = 0
        with _ParquetStream(writer.path / "edges.parquet", EDGE_SCHEMA) as edges_out:
            for src, dst in edge_chunks:
                edges_out.write(edges_table(src, dst))
                num_edges += len(src)
        split = nodes.column("split").to_numpy(zero_copy_only=False)
        writer.manifest = DatasetManifest(
            format=DATASET_FORMAT,
            name=name,
            fp=fp,
            num_nodes=nodes.num_rows,
            num_edges=num_edges,
            num_features=num_features,
            feature_format=feature_format,
            features_nonnegative=nonnegative,
            num_classes=num_classes,
            splits={s: int(np.count_nonzero(split == s)) for s in ("train", "val", "test", "none")},
            extra_columns=[c for c in nodes.column_names if c not in ("node_id", "label", "split")],
            **extra_manifest,
        )
    return DatasetRef.at(target, created=True)


class _ParquetStream:
    """A Parquet writer opened on the first chunk (so the schema can come from the data)."""

    def __init__(self, path: Path, schema: pa.Schema | None = None):
        self.path = path
        self.schema = schema
        self.writer: pq.ParquetWriter | None = None

    def __enter__(self) -> "_ParquetStream":
        if self.schema is not None:
            self.writer = pq.ParquetWriter(self.path, self.schema, compression=COMPRESSION)
        return self

    def write(self, table: pa.Table) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema, compression=COMPRESSION)
        self.writer.write_table(table)

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()
