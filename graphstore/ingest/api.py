"""Entry points of ingestion: fingerprint the source, skip if stored, else load, validate, write.

Every entry point but the synthetic one takes ``feature_format`` (``auto | dense | sparse``): how
the feature matrix is stored, part of the dataset fingerprint (``graphstore.ingest.features``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from typing import Any

import numpy as np

from graphstore.errors import InputError
from graphstore.fingerprint import file_digest
from graphstore.ingest import mat_source, npz_source, ogb_source, planetoid, synthetic
from graphstore.ingest.features import RequestedFormat, as_stored
from graphstore.ingest.graph import SourceGraph
from graphstore.ingest.splits import SplitFractions, stratified_split
from graphstore.ingest.tables import TableOptions, estimated_feature_bytes, estimated_rows, load_tables
from graphstore.ingest.validate import validate_graph
from graphstore.ingest.writer import dataset_fingerprint, write_dataset_files, write_graph
from graphstore.limits import check_memory, tables_estimate
from graphstore.layout import NAME_RULE, Store, is_valid_name
from graphstore.lookup import DatasetRef, existing_dataset
from graphstore.progress import Progress, no_progress

log = logging.getLogger(__name__)


def _ingest(
    store: Store,
    name: str,
    kind: str,
    options: dict[str, Any],
    content: dict[str, Any],
    load: Callable[[], SourceGraph],
    fractions: SplitFractions | None,
    feature_format: RequestedFormat,
) -> DatasetRef:
    fp = dataset_fingerprint(name, kind, options, content)
    found = existing_dataset(store, name, fp)
    if found is not None:
        log.info("dataset %s (fp %s) is already in the store: nothing to do", name, fp)
        return found
    graph = load()
    if graph.split is None:
        graph.split = stratified_split(graph.label, fractions or SplitFractions())
    validate_graph(graph)
    graph.x = as_stored(graph.x, feature_format)
    ref = write_graph(store, name, fp, graph, {"kind": kind, "options": options, "files": graph.files})
    log.info("dataset %s written: %d nodes, %d edges (fp %s)", name, ref.num_nodes, ref.num_edges, fp)
    return ref


def check_name(name: str) -> str:
    """Dataset names become folder names (``graphstore.layout.NAME_PATTERN``)."""
    if not is_valid_name(name):
        shown = name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
        raise InputError("--name", f"'{shown}' is not a valid dataset name ({NAME_RULE})")
    return name


def ingest_planetoid(store: Store, directory: Path, name: str, feature_format: RequestedFormat = "auto") -> DatasetRef:
    """A Planetoid folder; with ``auto`` its bag-of-words features are stored sparse."""
    content = planetoid.planetoid_content(directory)
    return _ingest(store, check_name(name), "planetoid", {"feature_format": feature_format}, content,
                   lambda: planetoid.load_planetoid(directory), None, feature_format)


def ingest_ogb(store: Store, directory: Path, name: str, undirected: bool = False,
               feature_format: RequestedFormat = "auto") -> DatasetRef:
    """An OGB folder; its features are dense, so ``auto`` stores them sparse only at density <= 0.1."""
    content = ogb_source.ogb_content(directory, name)

    def load() -> SourceGraph:
        graph = ogb_source.load_ogb(directory, name)
        graph.undirected = undirected
        return graph

    options = {"undirected": undirected, "feature_format": feature_format}
    return _ingest(store, check_name(name), "ogb", options, content, load, None, feature_format)


def ingest_npz(
    store: Store,
    path: Path,
    name: str,
    split_index: int | None = None,
    undirected: bool = True,
    fractions: SplitFractions | None = None,
    feature_format: RequestedFormat = "auto",
    force: bool = False,
    draw_split: bool = False,
) -> DatasetRef:
    """An ``.npz`` graph (heterophilous-graphs or gnn-benchmark layout, ``graphstore.ingest.npz_source``),
    or a ``.zip`` holding one.

    ``split_index`` picks one of the file's official splits (default 0); a file without splits,
    or any file with ``draw_split``, gets a stratified split drawn with ``fractions``. Only the
    options that apply enter the fingerprint (the split index, resolved, or the fractions). Both
    layouts hold undirected graphs, so ``undirected`` (every edge stored both ways) is the
    default. Refused before any array is decoded when the memory estimated from the arrays'
    headers exceeds what is available, unless ``force``.
    """
    name = check_name(name)
    fractions = fractions or SplitFractions()
    if draw_split and split_index is not None:
        raise InputError(str(path), "--split-index cannot be combined with --draw-split (which ignores the file's "
                                    "split masks)")
    with npz_source.NpzArrays(path) as arrays:
        index = None if draw_split else npz_source.resolve_split_index(arrays, split_index)
        options: dict[str, Any] = {"undirected": undirected, "feature_format": feature_format,
                                   **({"split": fractions.model_dump()} if index is None else {"split_index": index})}

        def load() -> SourceGraph:
            check_memory(npz_source.npz_estimate(arrays, undirected, feature_format), force)
            return npz_source.load_npz(arrays, index, undirected, feature_format)

        return _ingest(store, name, "npz", options, {"file": file_digest(path)}, load, fractions, feature_format)


def ingest_mat(store: Store, path: Path, name: str, key: str | None = None) -> DatasetRef:
    """A MATLAB ``.mat`` adjacency matrix (``graphstore.ingest.mat_source``): identity features,
    no labels, for the link task."""
    name = check_name(name)
    content = {"file": file_digest(path)} if path.is_file() else {}
    return _ingest(store, name, "mat", {"key": key}, content, lambda: mat_source.load_mat(path, key), None, "sparse")


def ingest_tables(
    store: Store,
    name: str,
    edges: Path,
    nodes: Path,
    features: Path | None,
    options: TableOptions,
    fractions: SplitFractions,
    force: bool = False,
) -> DatasetRef:
    """Edge, node and optional feature tables; refused before loading when the estimated memory
    (``graphstore.limits``) exceeds what is available, unless ``force``."""
    content = {}
    for role, path in (("edges", edges), ("nodes", nodes), ("features", features)):
        if path is not None:
            if not path.is_file():
                raise InputError(str(path), f"{role} file does not exist")
            content[role] = file_digest(path)
    # options added later enter the fingerprint only when set: fingerprints of other tables unchanged
    later = {name for name, default in (("remote_sources", False), ("missing_features", "constant"))
             if getattr(options, name) == default}
    opts = {**options.model_dump(exclude=later), "split": fractions.model_dump()}

    def load() -> SourceGraph:
        check_memory(tables_estimate(estimated_rows(edges), estimated_rows(nodes),
                                     estimated_feature_bytes(features) if features else 0, options.undirected), force)
        return load_tables(edges, nodes, features, options)

    return _ingest(store, check_name(name), "tables", opts, content, load, fractions, options.feature_format)


def ingest_synthetic(
    store: Store,
    name: str,
    options: synthetic.SyntheticOptions,
    fractions: SplitFractions,
    progress: Progress = no_progress,
    force: bool = False,
) -> DatasetRef:
    """Generate the SBM and stream it into the store (no in-memory SourceGraph for big graphs).

    The features are Gaussian (density 1) and always stored dense. Refused before anything is
    allocated when the estimated memory exceeds what is available, unless ``force``.
    """
    opts = {**options.model_dump(), "split": fractions.model_dump()}
    fp = dataset_fingerprint(check_name(name), "synthetic", opts, {"generator": synthetic.GENERATOR_VERSION})
    found = existing_dataset(store, name, fp)
    if found is not None:
        log.info("dataset %s (fp %s) is already in the store: nothing to do", name, fp)
        return found
    check_memory(synthetic.memory_estimate(options), force)
    rng = np.random.default_rng(options.seed)
    label = synthetic.sample_labels(options, rng)
    keys = synthetic.sample_undirected_pairs(options, label, rng, progress)
    nodes = synthetic.synthetic_nodes(options, label, fractions)
    ref = write_dataset_files(
        store,
        name,
        fp,
        nodes,
        synthetic.generate_features(options, label, rng, progress),
        synthetic.directed_edge_chunks(keys, options.nodes, progress),
        options.classes,
        {"source": {"kind": "synthetic", "options": opts}, "symmetric": True, "self_loops": 0, "duplicates_removed": 0},
    )
    log.info("synthetic dataset %s written: %d nodes, %d edges (fp %s)", name, ref.num_nodes, ref.num_edges, fp)
    return ref
