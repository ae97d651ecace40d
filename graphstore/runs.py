"""Run artefacts in the store: layer folders, per-part embeddings, and linking a reusable layer.

``runs/run=<rfp>/layer=<l>/`` holds ``model.pt``, ``manifest.json`` (with the layer fingerprint),
``part=<i>/embeddings.parquet`` (``node_id, h`` and, inductive runs, ``h_train, h_val``) and
``part=<i>/comm.parquet`` (what rank i sent while producing the layer). The last layer of a run
also holds ``metrics.parquet`` (training curves), ``evaluation.parquet`` (metrics per split) and
``part=<i>/predictions.parquet`` (``node_id, predicted, score, split`` of the nodes part i owns,
written by rank i: predictions stay where their nodes are).

A linked layer is verified first: its files, as linked, must match the sha256 checksums of the
source's manifest, which the new manifest then carries (``graphstore.integrity``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.atomic import atomic_artefact
from graphstore.integrity import verify_digests
from graphstore.layout import MANIFEST, Store
from graphstore.manifests import LayerManifest, read_manifest
from graphstore.parquet_io import COMPRESSION, features_array, features_matrix, read_table

PREDICTIONS = "predictions.parquet"
LINK_SCORES = "link_scores.parquet"  # task link: a rank's evaluation pairs scored by the last layer
RECOMMENDATIONS = "recommendations.parquet"  # task link with --recommend: a rank's nodes' best candidates


def write_embeddings(path: Path, node_id: np.ndarray, h: np.ndarray, views: dict[str, np.ndarray] | None = None) -> None:
    """(n,) ids and (n, d) float32 rows (full graph) -> ``embeddings.parquet``; other views of the
    inductive setting (``train``, ``val``) go to columns ``h_<view>``."""
    columns = {"node_id": pa.array(node_id, pa.int64()), "h": features_array(h)}
    for view, rows in (views or {}).items():
        columns[f"h_{view}"] = features_array(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, compression=COMPRESSION)


def read_embeddings(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(node_id (n,), view -> (n, d) rows) of one part of one layer; the full view is ``full``."""
    table = read_table(path)
    views = {"full": features_matrix(table.column("h"))}
    for name in table.column_names:
        if name.startswith("h_"):
            views[name[2:]] = features_matrix(table.column(name))
    return table.column("node_id").to_numpy(), views


def link_layer(store: Store, source: Path, target: Path, run_fp: str) -> None:
    """Reuse a finished layer in another run: hard links (copies across devices), committed atomically.

    The files as linked are hashed against the source manifest's checksums before the commit, so
    what is committed is what was verified; a difference is a ``StoreError`` naming the source
    file, and nothing is committed (``find_layer`` already skips sources that differ). The new
    manifest carries the source's digests (a source without checksums, from an older store, gets
    digests of the files as linked).
    """
    manifest = read_manifest(source, LayerManifest)
    with atomic_artefact(store, target) as writer:
        for path in source.rglob("*"):
            if path.name == MANIFEST and path.parent == source:
                continue
            dest = writer.path / path.relative_to(source)
            if path.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, dest)
            except OSError:
                shutil.copy2(path, dest)  # keeps the mtime: the digests' size and mtime still hold
        if manifest.files is not None:
            verify_digests(writer.path, manifest.files, source)
        writer.manifest = manifest.model_copy(update={"run": run_fp, "reused_from": str(source.relative_to(store.root))})
