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
edges (PyG's ``RandomLinkSplit`` fractions), the negatives uniform pairs of nodes. Or the user
names the held-out edges (``split_edges``: a CSV or Parquet table of ``src, dst, split``, e.g. the
edges table with a ``split`` column from a split by time): its ``val`` and ``test`` rows are held
out, every other edge trains, and only the negatives are drawn.

A site's dataset (``ingest tables --remote-sources``: its nodes and every edge into them) is split
without asking the other sites (``site_pairs``): whether an edge is held out, and in which split,
is a hash of its two end points and the seed, so every site holding a direction of it decides
alike and no site trains on an edge another site holds out. Each held-out edge is scored once: by
the site holding both ends in its ``src < dst`` direction, else by the site holding the smaller
id. Its negatives are pairs of one of its nodes and a node it knows (its own, or an edge's
remote source) that are no edge it knows.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, model_validator

from graphstore.atomic import atomic_artefact
from graphstore.errors import InputError
from graphstore.fingerprint import file_digest
from graphstore.ingest.tables import integer_column, read_any_table, require_column
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
    split_edges: str | None = Field(
        None, description="A CSV or Parquet table with columns src, dst and split (train, val or test): its val and "
        "test edges are held out instead of drawn fractions (e.g. the edges table with a split column); the seed "
        "draws the negatives only.")

    @model_validator(mode="after")
    def _fits(self) -> "LinkSplitOptions":
        if self.val + self.test >= 1:
            raise ValueError(f"val ({self.val}) + test ({self.test}) edge fractions must stay below 1")
        return self


def candidate_edges(src: np.ndarray, dst: np.ndarray, symmetric: bool) -> np.ndarray:
    """(E,) bool: the edges a split may hold out, the non-loops (each undirected edge once, as
    ``src < dst``, for a symmetric graph)."""
    return (src < dst) if symmetric else (src != dst)


def held_out(src: np.ndarray, dst: np.ndarray, symmetric: bool, options: LinkSplitOptions,
             rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Positions (into ``src``/``dst``, node positions) of the candidate edges chosen per split,
    and the (E,) bool mask of the edges that stay for training.

    Candidates are the non-loop edges (for a symmetric graph each undirected edge once, as
    ``src < dst``); ``int(fraction * candidates)`` of them go to test, then to val."""
    candidates = np.flatnonzero(candidate_edges(src, dst, symmetric))
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


def edge_rows(src: np.ndarray, dst: np.ndarray, symmetric: bool) -> np.ndarray:
    """(E, 2) the edges as rows, each as (min, max) when ``symmetric`` (both directions alike)."""
    return np.stack([np.minimum(src, dst), np.maximum(src, dst)] if symmetric else [src, dst], axis=1)


def listed_split(path: Path, src_id: np.ndarray, dst_id: np.ndarray, symmetric: bool, site: bool = False) -> np.ndarray:
    """(E,) the split ``path`` gives each edge ``src_id -> dst_id`` of the graph (ids): ``val``,
    ``test``, or ``train`` for an edge it lists as such or does not list (for a symmetric graph a
    row names both directions). ``InputError`` naming the file, column and row of a bad row, or of
    an edge the graph lacks (a ``site`` ignores the rows of edges other sites hold)."""
    table = read_any_table(path)
    src, dst = integer_column(table, "src", path), integer_column(table, "dst", path)
    split = np.asarray(require_column(table, "split", path).to_pylist(), dtype=object)
    bad = np.flatnonzero(~np.isin(split, ["train", "val", "test"]))
    if len(bad):
        raise InputError(str(path), f"expected train, val or test, found {split[bad[0]]!r}", "split", int(bad[0]) + 1)
    rows = [edge_rows(src, dst, symmetric), edge_rows(src_id, dst_id, symmetric)]
    _, ids = np.unique(np.concatenate(rows), axis=0, return_inverse=True)  # one id per (unordered) edge
    ids = ids.reshape(-1)
    listed, graph = ids[:len(src)], ids[len(src):]
    absent = np.flatnonzero(~np.isin(listed, graph))
    if len(absent) and not site:
        row = int(absent[0])
        raise InputError(str(path), f"{src[row]} -> {dst[row]} is not an edge of the graph", "src", row + 1)
    of_id = np.full(len(ids), "train", dtype=object)
    of_id[listed] = split
    if (of_id[listed] != split).any():
        row = int(np.flatnonzero(of_id[listed] != split)[0])
        raise InputError(str(path), f"{src[row]} -> {dst[row]} is listed in two splits", "split", row + 1)
    out = of_id[graph]
    out[src_id == dst_id] = "train"  # self loops always stay
    return out.astype(str)


def sample_pairs(need: int, m: int, sources: Callable[[int], np.ndarray], targets: Callable[[int], np.ndarray],
                 taken: np.ndarray, undirected: bool) -> np.ndarray:
    """``need`` distinct keys ``u * m + v`` of pairs u != v drawn in batches (``sources(size)``,
    then ``targets(size)``: positions < m) whose key is not in ``taken`` (sorted keys of the
    edges); ``undirected``: a pair is stored as (min, max) and its reverse must not be taken either."""
    found = np.empty(0, np.int64)
    while len(found) < need:
        u = sources(2 * (need - len(found)) + 16)
        v = targets(len(u))
        if undirected:
            u, v = np.minimum(u, v), np.maximum(u, v)
        keys = u * m + v
        ok = (u != v) & ~np.isin(keys, taken) & ~np.isin(keys, found)
        if undirected:
            ok &= ~np.isin(v * m + u, taken)
        fresh = keys[ok]
        _, first = np.unique(fresh, return_index=True)
        found = np.concatenate([found, fresh[np.sort(first)]])[:need]
    return found


def negative_pairs(num_nodes: int, counts: dict[str, int], taken: np.ndarray, symmetric: bool,
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per split, (count, 2) node positions of distinct pairs u != v whose key ``u * N + v`` (and,
    for a symmetric graph, the reverse's) is not in ``taken`` (sorted keys of the edges), and
    that no other split has drawn."""
    need = sum(counts.values())
    n = np.int64(num_nodes)
    if need > num_nodes * (num_nodes - 1) // (2 if symmetric else 1) - len(taken) // (2 if symmetric else 1):
        raise InputError("--test-edges", f"the graph has too few node pairs without an edge for {need} negatives")
    uniform = lambda size: rng.integers(0, n, size=size)  # noqa: E731
    found = sample_pairs(need, int(n), uniform, uniform, taken, symmetric)
    out, start = {}, 0
    for name, count in counts.items():
        out[name] = np.stack(np.divmod(found[start:start + count], n), axis=1)
        start += count
    return out


def pair_table(src: np.ndarray, dst: np.ndarray, label: int, split: str) -> pa.Table:
    """``link_pairs.parquet`` rows: the (p,) pairs ``src -> dst`` (ids), all with ``label`` and ``split``."""
    return pa.table({"src": src, "dst": dst, "label": np.full(len(src), label, np.int8),
                     "split": pa.array([split] * len(src), pa.string())}, schema=PAIR_SCHEMA)


def pair_uniform(src: np.ndarray, dst: np.ndarray, seed: int) -> np.ndarray:
    """(E,) float64 in [0, 1): a hash of the unordered pair {src, dst} and ``seed`` (splitmix64's
    finaliser), the same wherever the pair is stored."""
    low, high = np.minimum(src, dst).astype(np.uint64), np.maximum(src, dst).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = low * np.uint64(0x9E3779B97F4A7C15) + high + np.uint64(seed) * np.uint64(0xD1B54A32D192ED03)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def site_pairs(node_id: np.ndarray, src: np.ndarray, dst: np.ndarray, options: LinkSplitOptions,
               rng: np.random.Generator) -> tuple[pa.Table, np.ndarray]:
    """A site's split (see the module docstring): its pairs table and the (E,) mask of the edges
    (ids; ``dst`` its own) that stay for training."""
    if options.split_edges is not None:
        split = listed_split(Path(options.split_edges), src, dst, symmetric=True, site=True)
    else:
        draw = pair_uniform(src, dst, options.seed)
        split = np.where(draw < options.test, "test", np.where(draw < options.test + options.val, "val", "train"))
        split[src == dst] = "train"
    keep = split == "train"
    known = np.union1d(node_id, src)  # every id this site knows: dense positions for the pair keys
    s, d = np.searchsorted(known, src), np.searchsorted(known, dst)
    own_src = np.isin(src, node_id)
    scored = ~keep & np.where(own_src, src < dst, dst < src)
    m = np.int64(len(known))
    taken = np.unique(np.concatenate([s * m + d, d * m + s]))  # both directions: no reverse check needed
    owned = np.searchsorted(known, node_id)
    pieces = []
    for name in ("val", "test"):
        rows = np.flatnonzero(scored & (split == name))
        found = sample_pairs(len(rows), int(m), lambda size: rng.integers(0, m, size=size),
                             lambda size: owned[rng.integers(0, len(owned), size=size)], taken, undirected=False)
        neg_u, neg_v = np.divmod(found, m)
        taken = np.union1d(taken, np.concatenate([found, neg_v * m + neg_u]))  # no pair in both splits, either way
        pieces += [pair_table(src[rows], dst[rows], 1, name), pair_table(known[neg_u], known[neg_v], 0, name)]
    return pa.concat_tables(pieces), keep


def central_pairs(node_id: np.ndarray, src_id: np.ndarray, dst_id: np.ndarray, symmetric: bool,
                  options: LinkSplitOptions, rng: np.random.Generator) -> tuple[pa.Table, np.ndarray]:
    """A whole graph's split (see the module docstring): its pairs table and the (E,) mask of the
    edges that stay for training."""
    src, dst = np.searchsorted(node_id, src_id), np.searchsorted(node_id, dst_id)
    if options.split_edges is not None:
        split = listed_split(Path(options.split_edges), src_id, dst_id, symmetric)
        candidates = candidate_edges(src, dst, symmetric)
        chosen = {name: np.flatnonzero(candidates & (split == name)) for name in ("test", "val")}
        keep = split == "train"
    else:
        chosen, keep = held_out(src, dst, symmetric, options, rng)
    taken = np.unique(src.astype(np.int64) * len(node_id) + dst)
    negatives = negative_pairs(len(node_id), {s: len(chosen[s]) for s in ("val", "test")}, taken, symmetric, rng)
    pieces = []
    for split in ("val", "test"):
        rows, (neg_u, neg_v) = chosen[split], negatives[split].T
        pieces += [pair_table(node_id[src[rows]], node_id[dst[rows]], 1, split),
                   pair_table(node_id[neg_u], node_id[neg_v], 0, split)]
    return pa.concat_tables(pieces), keep


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
    opts = options.model_dump(exclude={"split_edges"} if options.split_edges is None else set())
    content = {"dataset": source.fp}
    if options.split_edges is not None:
        split_file = Path(options.split_edges)
        if not split_file.is_file():
            raise InputError(options.split_edges, "file does not exist")
        content["split_edges"] = file_digest(split_file)
    fp = dataset_fingerprint(name, "link_split", opts, content)
    found = existing_dataset(store, name, fp)
    if found is not None:
        log.info("dataset %s (fp %s) is already in the store: nothing to do", name, fp)
        return found
    verify_files(source.path, DATASET_FILES, DatasetManifest)
    node_id = read_table(source.path / "nodes.parquet", columns=["node_id"]).column("node_id").to_numpy()
    edges = read_table(source.path / "edges.parquet")
    src, dst = edges.column("src").to_numpy(), edges.column("dst").to_numpy()
    rng = np.random.default_rng(options.seed)
    if manifest.remote_nodes:
        pairs, keep = site_pairs(node_id, src, dst, options, rng)
    else:
        pairs, keep = central_pairs(node_id, src, dst, manifest.symmetric, options, rng)
    split, label = pairs.column("split").to_numpy(zero_copy_only=False), pairs.column("label").to_numpy()
    if not np.count_nonzero(split == "test") and not manifest.remote_nodes:
        if options.split_edges is not None:
            raise InputError(options.split_edges, f"lists no test edge of {source.name}", "split")
        raise InputError("--test-edges", f"{options.test} of the {len(src)} edges of {source.name} holds out no edge")
    target = store.dataset_dir(name, fp)
    with atomic_artefact(store, target) as writer:
        for file in ("nodes.parquet", "features.parquet"):
            link_or_copy(source.path / file, writer.path / file)
        pq.write_table(edges_table(src[keep], dst[keep]), writer.path / "edges.parquet", compression=COMPRESSION)
        pq.write_table(pairs, writer.path / LINK_PAIRS, compression=COMPRESSION)
        counts = {"train_positive": int(np.count_nonzero(keep & (src != dst)) // (2 if manifest.symmetric else 1))}
        for which in ("val", "test"):
            counts[f"{which}_positive"] = int(np.count_nonzero((split == which) & (label == 1)))
            counts[f"{which}_negative"] = int(np.count_nonzero((split == which) & (label == 0)))
        writer.manifest = manifest.model_copy(update={
            "name": name, "fp": fp, "num_edges": int(np.count_nonzero(keep)), "task": "link", "link_pairs": counts,
            "source": {"kind": "link_split", "dataset": source.fp, "dataset_name": source.name, "options": opts},
            "files": None, "created_at": utc_now(),
        })
    ref = DatasetRef.at(target, created=True)
    log.info("link dataset %s written from %s: %s (fp %s)", name, source.name, counts, fp)
    return ref
