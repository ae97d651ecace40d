"""A link-prediction dataset derived from a stored dataset: its edges split into the ones training
may see and held-out positives, with negatives drawn once, so that every strategy and every re-run
is scored on the same pairs.

``split_links`` writes a new dataset version (``task = "link"``):

- ``nodes.parquet`` and ``features.parquet``: the source's files, hard-linked (copied across file
  systems);
- ``edges.parquet``: the training edges only. Message passing reads nothing else, so no
  validation or test edge can reach it, in any strategy or partition;
- ``link_pairs.parquet``: ``src, dst, label, split`` of the validation and test pairs: positives
  (the held-out edges, one row per undirected edge) and as many negatives (node pairs that are no
  edge of the source graph in either direction, no self pairs, each pair once over both splits).

For an undirected (symmetric) source, an undirected edge is held out with both its directions; a
directed source holds out directed edges. Self loops always stay in training. The split is drawn
with ``LinkSplitOptions.seed``: the held-out edges are a random ``val`` / ``test`` fraction of the
edges (PyG's ``RandomLinkSplit`` fractions), the negatives uniform pairs of nodes.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, model_validator

from graphstore.atomic import atomic_artefact
from graphstore.errors import InputError
from graphstore.integrity import verify_files
from graphstore.ingest.writer import dataset_fingerprint
from graphstore.layout import DATASET_FILES, LINK_PAIRS, Store
from graphstore.lookup import DatasetRef, existing_dataset
from graphstore.manifests import DatasetManifest, utc_now
from graphstore.parquet_io import COMPRESSION, edges_table, read_table

log = logging.getLogger(__name__)
PAIR_SCHEMA = pa.schema([("src", pa.int64()), ("dst", pa.int64()), ("label", pa.int8()), ("split", pa.string())])


class LinkSplitOptions(BaseModel):
    """How the edges are held out (every field enters the new dataset's fingerprint)."""

    val: float = Field(0.05, ge=0, lt=1, json_schema_extra={"cli": "val_edges"},
                       description="Fraction of the edges held out for validation (with as many negative pairs).")
    test: float = Field(0.1, gt=0, lt=1, json_schema_extra={"cli": "test_edges"},
                        description="Fraction of the edges held out for testing (with as many negative pairs).")
    seed: int = Field(0, ge=0, json_schema_extra={"cli": "link_seed"},
                      description="Seed of the edge split and of the negative pairs.")

    @model_validator(mode="after")
    def _fits(self) -> "LinkSplitOptions":
        if self.val + self.test >= 1:
            raise ValueError(f"val ({self.val}) + test ({self.test}) edge fractions must stay below 1")
        return self


def held_out(src: np.ndarray, dst: np.ndarray, symmetric: bool, options: LinkSplitOptions,
             rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Positions (into ``src``/``dst``, node positions) of the candidate edges chosen per split,
    and the (E,) bool mask of the edges that stay for training.

    Candidates are the non-loop edges (for a symmetric graph each undirected edge once, as
    ``src < dst``); ``int(fraction * candidates)`` of them go to test, then to val."""
    candidates = np.flatnonzero((src < dst) if symmetric else (src != dst))
    order = rng.permutation(candidates)
    n_test, n_val = int(options.test * len(candidates)), int(options.val * len(candidates))
    chosen = {"test": np.sort(order[:n_test]), "val": np.sort(order[n_test:n_test + n_val])}
    keep = np.ones(len(src), bool)
    removed = np.concatenate(list(chosen.values()))
    keep[removed] = False
    if symmetric:  # the reverse direction of each held-out edge
        n = np.int64(max(int(src.max(initial=0)), int(dst.max(initial=0))) + 1)
        keys = src.astype(np.int64) * n + dst
        reverse = dst[removed].astype(np.int64) * n + src[removed]
        keep &= ~np.isin(keys, reverse)
    return chosen, keep


def negative_pairs(num_nodes: int, counts: dict[str, int], taken: np.ndarray, symmetric: bool,
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per split, (count, 2) node positions of distinct pairs u != v whose key ``u * N + v`` (and,
    for a symmetric graph, the reverse's) is not in ``taken`` (sorted keys of the edges), and
    that no other split has drawn."""
    need = sum(counts.values())
    n = np.int64(num_nodes)
    if need > num_nodes * (num_nodes - 1) // (2 if symmetric else 1) - len(taken) // (2 if symmetric else 1):
        raise InputError("--test-edges", f"the graph has too few node pairs without an edge for {need} negatives")
    found = np.empty(0, np.int64)
    while len(found) < need:
        u = rng.integers(0, n, size=2 * (need - len(found)) + 16)
        v = rng.integers(0, n, size=len(u))
        if symmetric:
            u, v = np.minimum(u, v), np.maximum(u, v)
        keys = u * n + v
        ok = (u != v) & ~np.isin(keys, taken) & ~np.isin(keys, found)
        if symmetric:
            ok &= ~np.isin(v * n + u, taken)
        fresh = keys[ok]
        _, first = np.unique(fresh, return_index=True)
        found = np.concatenate([found, fresh[np.sort(first)]])[:need]
    out, start = {}, 0
    for name, count in counts.items():
        out[name] = np.stack(np.divmod(found[start:start + count], n), axis=1)
        start += count
    return out


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link of the immutable ``source`` (a copy across file systems)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def split_links(store: Store, source: DatasetRef, name: str, options: LinkSplitOptions) -> DatasetRef:
    """Write (or find) the link dataset ``name`` derived from ``source`` (see the module docstring)."""
    manifest = source.manifest
    if manifest.task == "link":
        raise InputError(str(source.path), f"dataset {source.name} is a link split already; split its source instead")
    if manifest.remote_nodes:
        raise InputError(str(source.path), f"dataset {source.name} is a site's dataset (edges from other sites); "
                                           "link splits of site data are not supported")
    opts = options.model_dump()
    fp = dataset_fingerprint(name, "link_split", opts, {"dataset": source.fp})
    found = existing_dataset(store, name, fp)
    if found is not None:
        log.info("dataset %s (fp %s) is already in the store: nothing to do", name, fp)
        return found
    verify_files(source.path, DATASET_FILES, DatasetManifest)
    node_id = read_table(source.path / "nodes.parquet", columns=["node_id"]).column("node_id").to_numpy()
    edges = read_table(source.path / "edges.parquet")
    src = np.searchsorted(node_id, edges.column("src").to_numpy())
    dst = np.searchsorted(node_id, edges.column("dst").to_numpy())
    rng = np.random.default_rng(options.seed)
    chosen, keep = held_out(src, dst, manifest.symmetric, options, rng)
    if not len(chosen["test"]):
        raise InputError("--test-edges", f"{options.test} of the {len(src)} edges of {source.name} holds out no edge")
    taken = np.unique(src.astype(np.int64) * len(node_id) + dst)
    negatives = negative_pairs(len(node_id), {s: len(chosen[s]) for s in ("val", "test")}, taken,
                               manifest.symmetric, rng)
    pieces = []
    for split in ("val", "test"):
        rows = chosen[split]
        for label, (u, v) in ((1, (src[rows], dst[rows])), (0, tuple(negatives[split].T))):
            pieces.append(pa.table({"src": node_id[u], "dst": node_id[v], "label": np.full(len(u), label, np.int8),
                                    "split": pa.array([split] * len(u), pa.string())}, schema=PAIR_SCHEMA))
    pairs = pa.concat_tables(pieces)
    target = store.dataset_dir(name, fp)
    with atomic_artefact(store, target) as writer:
        for file in ("nodes.parquet", "features.parquet"):
            link_or_copy(source.path / file, writer.path / file)
        pq.write_table(edges_table(node_id[src[keep]], node_id[dst[keep]]), writer.path / "edges.parquet",
                       compression=COMPRESSION)
        pq.write_table(pairs, writer.path / LINK_PAIRS, compression=COMPRESSION)
        counts = {"train_positive": int(np.count_nonzero(keep & (src != dst)) // (2 if manifest.symmetric else 1))}
        for split in ("val", "test"):
            counts[f"{split}_positive"] = counts[f"{split}_negative"] = len(chosen[split])
        writer.manifest = manifest.model_copy(update={
            "name": name, "fp": fp, "num_edges": int(np.count_nonzero(keep)), "task": "link", "link_pairs": counts,
            "source": {"kind": "link_split", "dataset": source.fp, "dataset_name": source.name, "options": opts},
            "files": None, "created_at": utc_now(),
        })
    ref = DatasetRef.at(target, created=True)
    log.info("link dataset %s written from %s: %s (fp %s)", name, source.name, counts, fp)
    return ref
