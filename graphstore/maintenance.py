"""Listing artefacts and removing what crashed writers left behind."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from graphstore.atomic import lock_is_free
from graphstore.errors import StoreError
from graphstore.layout import MANIFEST, TMP_PREFIX, Store
from graphstore.manifests import read_any_manifest


@dataclass(frozen=True)
class Artefact:
    kind: str  # dataset | partition | layer | run | corrupt
    name: str
    fp: str
    path: Path
    bytes: int
    created_at: str


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_artefacts(store: Store) -> list[Artefact]:
    """Every completed artefact (a folder with a manifest), datasets first."""
    found = []
    for manifest_path in sorted(store.root.glob(f"**/{MANIFEST}")):
        if any(part.startswith(TMP_PREFIX) for part in manifest_path.relative_to(store.root).parts):
            continue
        folder = manifest_path.parent
        try:
            manifest = read_any_manifest(folder)
        except StoreError:
            found.append(Artefact("corrupt", "", "", folder, folder_bytes(folder), ""))
            continue
        name = getattr(manifest, "name", None) or getattr(manifest, "dataset_name", None) or getattr(manifest, "label", "")
        found.append(Artefact(manifest.kind, name, manifest.fp, folder, folder_bytes(folder), manifest.created_at))
    order = {"dataset": 0, "partition": 1, "run": 2, "layer": 3}
    return sorted(found, key=lambda a: (order.get(a.kind, 9), a.created_at, str(a.path)))


def stale_temp_paths(store: Store) -> list[Path]:
    """Temp folders/files of writers that are no longer running (their target's lock is free)."""
    stale = []
    for path in sorted(store.root.glob(f"**/{TMP_PREFIX}*")):
        if any(part.startswith(TMP_PREFIX) for part in path.relative_to(store.root).parts[:-1]):
            continue  # inside another temp folder: removed with it
        target_name = path.name[len(TMP_PREFIX):].rsplit("-", 2)[0]
        if lock_is_free(store, path.parent / target_name):
            stale.append(path)
    return stale


def garbage_collect(store: Store) -> list[tuple[Path, int]]:
    """Remove stale temp folders and files; returns (path, bytes freed) for each."""
    removed = []
    for path in stale_temp_paths(store):
        size = folder_bytes(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append((path, size))
    return removed
