"""Finding artefacts in the store: datasets by name or fingerprint, partitions by options, finished
layers by fingerprint, completed runs. Every store lookup lives here.

A corrupt artefact is never found as if it were good (``graphstore.integrity``): the lookups that
decide whether something must be built (``existing_dataset``, ``stored_partition``,
``layer_fp_of``) report an artefact with an unreadable manifest or changed files (quick check:
size and mtime, hashed when the mtime differs) as missing, so that it is rebuilt; ``find_layer``
hashes a reuse candidate in full and skips it when it differs. Listings skip unreadable manifests
(with a warning) instead of failing on them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from graphstore.errors import StoreError
from graphstore.fingerprint import fingerprint
from graphstore.integrity import intact_manifest
from graphstore.layout import MANIFEST, Store, is_complete
from graphstore.manifests import DatasetManifest, LayerManifest, Manifest, PartitionManifest, RunManifest, read_manifest
from graphstore.partition.methods import PREVIOUS, PartitionOptions

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Manifest)


def readable_manifests(manifest_paths: Iterable[Path], model: type[M],
                       skipped: list[Path] | None = None) -> Iterator[M]:
    """The manifests at ``manifest_paths`` that can be read as ``model``; the others are skipped
    with a warning naming them (and appended to ``skipped``): ``retexo store verify`` lists them,
    a rebuild replaces them."""
    for path in manifest_paths:
        try:
            yield read_manifest(path.parent, model)
        except StoreError as exc:
            log.warning("skipped: %s", exc)
            if skipped is not None:
                skipped.append(path)

PARTITION_FORMAT = 2  # bump when the on-disk layout of a partition changes (2: sparse feature layout)


@dataclass(frozen=True)
class DatasetRef:
    """A dataset in the store (small: safe to return from Prefect tasks)."""

    name: str
    fp: str
    path: Path
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    created: bool  # False when the store already had this fingerprint

    @classmethod
    def at(cls, path: Path, created: bool = False) -> "DatasetRef":
        m = read_manifest(path, DatasetManifest)
        return cls(m.name, m.fp, path, m.num_nodes, m.num_edges, m.num_features, m.num_classes, created)

    @property
    def manifest(self) -> DatasetManifest:
        return read_manifest(self.path, DatasetManifest)


@dataclass(frozen=True)
class PartitionRef:
    """A partition artefact in the store (small: safe to return from Prefect tasks)."""

    dataset_fp: str
    fp: str
    path: Path
    method: str
    parts: int
    edge_cut: int
    halo_total: int
    created: bool

    @classmethod
    def at(cls, path: Path, created: bool = False) -> "PartitionRef":
        m = read_manifest(path, PartitionManifest)
        return cls(m.dataset, m.fp, path, m.method, m.parts, m.edge_cut, m.halo_total, created)

    @property
    def manifest(self) -> PartitionManifest:
        return read_manifest(self.path, PartitionManifest)


def existing_dataset(store: Store, name: str, fp: str) -> DatasetRef | None:
    """The stored dataset ``name`` with fingerprint ``fp``; None when it is missing or corrupt
    (quick check), so that ingesting it again rewrites it."""
    path = store.dataset_dir(name, fp)
    return DatasetRef.at(path) if intact_manifest(path, DatasetManifest) is not None else None


def find_dataset(store: Store, name_or_fp: str) -> DatasetRef:
    """The dataset called ``name_or_fp`` (its newest version), or the one with that fingerprint.

    Its files are not checked here: whoever reads them verifies them (a corrupt version is named,
    never silently replaced by an older one)."""
    unreadable: list[Path] = []
    paths = store.datasets_dir().glob(f"name=*/fp=*/{MANIFEST}")
    manifests = list(readable_manifests(paths, DatasetManifest, unreadable))
    candidates = [(m.created_at, store.dataset_dir(m.name, m.fp)) for m in manifests if name_or_fp in (m.name, m.fp)]
    if not candidates:
        known = sorted({m.name for m in manifests})
        corrupt = (f"; {len(unreadable)} dataset manifest(s) cannot be read, e.g. {unreadable[0]} (ingest the data "
                   "again to replace it)" if unreadable else "")
        raise StoreError(
            f"no dataset '{name_or_fp}' in store {store.root}; known datasets: {', '.join(known) or 'none'} "
            f"(run `retexo ingest ...` first){corrupt}"
        )
    return DatasetRef.at(max(candidates)[1])


def partition_fingerprint(dataset_fp: str, options: PartitionOptions) -> str:
    """The fingerprint of a partition of ``dataset_fp``; ``options.stable_from`` must be resolved."""
    if options.stable_from == PREVIOUS:
        raise ValueError("stable_from 'previous' must be resolved (resolve_stable_from) before fingerprinting")
    return fingerprint({"format": PARTITION_FORMAT, "dataset": dataset_fp, **options.fingerprint_payload()})


def find_partition(store: Store, dataset: DatasetRef, options: PartitionOptions) -> PartitionRef | None:
    """The stored partition of ``dataset`` with ``options`` (anchor resolved first), None when missing."""
    return stored_partition(store, dataset, resolve_stable_from(store, dataset, options))


def stored_partition(store: Store, dataset: DatasetRef, resolved: PartitionOptions) -> PartitionRef | None:
    """Like ``find_partition``, for options whose ``stable_from`` is already resolved; a corrupt
    partition (quick check) counts as missing, so that building it again replaces it."""
    path = store.partition_dir(dataset.fp, partition_fingerprint(dataset.fp, resolved))
    return PartitionRef.at(path) if intact_manifest(path, PartitionManifest) is not None else None


def partition_by_fp(store: Store, fp: str) -> PartitionRef:
    """The completed partition (of any dataset) whose fingerprint is ``fp`` or starts with it."""
    folders = [p for p in (store.root / "partitions").glob("dataset=*/fp=*") if is_complete(p)]
    matches = sorted(p for p in folders if p.name.removeprefix("fp=").startswith(fp))
    if len(matches) == 1:
        return PartitionRef.at(matches[0])
    if matches:
        found = ", ".join(p.name.removeprefix("fp=") for p in matches[:5])
        raise StoreError(f"stable_from '{fp}' matches {len(matches)} partitions ({found}): give more of the fingerprint")
    raise StoreError(f"stable_from '{fp}': no partition with this fingerprint in store {store.root} "
                     f"({len(folders)} stored; see the partitions view of `retexo sql`)")


def previous_version(store: Store, dataset: DatasetRef) -> DatasetRef | None:
    """The newest version of ``dataset.name`` created before ``dataset`` (manifest ``created_at``)."""
    created = dataset.manifest.created_at
    paths = store.datasets_dir().glob(f"name={dataset.name}/fp=*/{MANIFEST}")
    older = [(m.created_at, m.fp) for m in readable_manifests(paths, DatasetManifest)
             if m.fp != dataset.fp and m.created_at < created]
    return DatasetRef.at(store.dataset_dir(dataset.name, max(older)[1])) if older else None


def newest_partition(store: Store, dataset_fp: str, method: str, parts: int) -> PartitionRef | None:
    """The newest completed partition of ``dataset_fp`` with this method and number of parts."""
    found = []
    paths = (store.root / "partitions").glob(f"dataset={dataset_fp}/fp=*/{MANIFEST}")
    for m in readable_manifests(paths, PartitionManifest):
        if m.method == method and m.parts == parts:
            found.append((m.created_at, m.fp, store.partition_dir(dataset_fp, m.fp)))
    return PartitionRef.at(max(found)[2]) if found else None


def resolve_stable_from(store: Store, dataset: DatasetRef, options: PartitionOptions) -> PartitionOptions:
    """``options`` with ``stable_from`` resolved to an anchor's full fingerprint, or None.

    ``previous`` is the newest partition with the same method and parts of the previous version of
    the dataset (``previous_version``); without one it resolves to None (partition from scratch).
    The anchor depends only on earlier versions, so building on the newest version and asking
    again resolves to the same anchor (the build is cached). Raises ``StoreError`` for an unknown
    or ambiguous fingerprint and for an anchor with a different number of parts.
    """
    wanted = options.stable_from
    if wanted is None:
        return options
    if wanted == PREVIOUS:
        earlier = previous_version(store, dataset)
        anchor = newest_partition(store, earlier.fp, options.method, options.parts) if earlier else None
        if anchor is None:
            log.debug("stable_from previous: no earlier %s partition of %s into %d parts; partitioning from scratch",
                      options.method, dataset.name, options.parts)
            return options.model_copy(update={"stable_from": None})
    else:
        anchor = partition_by_fp(store, wanted)
        if anchor.parts != options.parts:
            raise StoreError(f"stable_from partition {anchor.fp} has {anchor.parts} parts, but {options.parts} "
                             "were asked for (an anchor must have the same number of parts)")
    log.debug("stable_from %s of %s resolved to partition %s", wanted, dataset.name, anchor.fp)
    return options.model_copy(update={"stable_from": anchor.fp})


def layer_fp_of(directory: Path) -> str | None:
    """The fingerprint of a finished layer folder; None when it is not finished: no manifest, an
    unreadable one, or files that changed since the commit (quick check; a warning names the file,
    and the layer is retrained)."""
    manifest = intact_manifest(directory, LayerManifest,
                               consequence="the layer is not used: it is trained again (or reused from another run)")
    return manifest.fp if manifest is not None else None


def find_layer(store: Store, layer: int, layer_fp: str) -> Path | None:
    """A finished ``layer=<layer>`` folder of any run whose fingerprint is ``layer_fp``, whose
    files match their checksums (hashed in full, once per process): a corrupt layer is never
    reused (a warning names the file it skips)."""
    for manifest_path in sorted((store.root / "runs").glob(f"run=*/layer={layer}/{MANIFEST}")):
        try:
            fp = read_manifest(manifest_path.parent, LayerManifest).fp
        except StoreError:
            continue
        if fp == layer_fp and intact_manifest(manifest_path.parent, LayerManifest, "full",
                                              consequence="this layer is not reused") is not None:
            return manifest_path.parent
    return None


def completed_run(store: Store, run: str) -> RunManifest:
    """The manifest of a completed run, by full fingerprint or a unique prefix."""
    matches = [p for p in (store.root / "runs").glob(f"run={run}*") if is_complete(p)]
    if len(matches) != 1:
        known = sorted(p.name.removeprefix("run=") for p in (store.root / "runs").glob("run=*") if is_complete(p))
        raise StoreError(f"no unique completed run '{run}' in {store.root} (completed runs: {', '.join(known) or 'none'})")
    return read_manifest(matches[0], RunManifest)


def dataset_runs(store: Store, dataset_fp: str) -> list[RunManifest]:
    """Every completed run on the dataset version ``dataset_fp``, oldest first."""
    runs = readable_manifests(sorted((store.root / "runs").glob(f"run=*/{MANIFEST}")), RunManifest)
    return sorted((r for r in runs if r.dataset == dataset_fp), key=lambda r: r.created_at)
