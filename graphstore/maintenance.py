"""Listing artefacts and removing what crashed writers left behind, and corrupt artefacts
(``remove_corrupt``, after ``graphstore.integrity.verify_store``)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from graphstore.atomic import lock_is_free, temp_sibling, writer_lock
from graphstore.errors import StoreError
from graphstore.history import mark_abandoned_runs, mark_if_started, run_unheld
from graphstore.layout import MANIFEST, TMP_PREFIX, Store
from graphstore.manifests import read_any_manifest
from graphstore.integrity import ArtefactCheck, artefact_files, check_folder, manifest_stamp


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


def stale_temp_paths(store: Store, under: Path | None = None) -> list[Path]:
    """Temp folders/files of writers that are no longer running (their target's lock is free), in
    the whole store or ``under`` one of its folders."""
    stale = []
    top = store.root if under is None else under
    for path in sorted(top.glob(f"**/{TMP_PREFIX}*")):
        if any(part.startswith(TMP_PREFIX) for part in path.relative_to(top).parts[:-1]):
            continue  # inside another temp folder: removed with it
        target_name = path.name[len(TMP_PREFIX):].rsplit("-", 2)[0]
        if lock_is_free(store, path.parent / target_name):
            stale.append(path)
    return stale


def garbage_collect(store: Store) -> tuple[list[tuple[Path, int]], list[str]]:
    """Remove stale temp folders and files, after marking ``interrupted`` the runs left ``started``
    by a launcher that is gone; returns (path, bytes freed) of each removal, and the marked runs."""
    marked = mark_abandoned_runs(store)
    return remove_paths(stale_temp_paths(store)), marked


def remove_paths(paths: list[Path]) -> list[tuple[Path, int]]:
    """Remove each folder or file; (path, bytes freed) of each."""
    removed = []
    for path in paths:
        size = folder_bytes(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append((path, size))
    return removed


def finish_abandoned_run(store: Store, run: str, detail: str, wait_s: float) -> tuple[bool, list[Path]]:
    """Once no process holds ``run`` any more (its launcher died, and the launcher's workers, which
    exit at once then, are gone; trying for up to ``wait_s`` seconds): record ``interrupted``
    (with ``detail``) if its last event is ``started``, and remove the temp folders and files in
    its folder. Returns (marked, removed paths); (False, []) when the run is still held."""
    with run_unheld(store, run, wait_s) as unheld:
        if not unheld:
            return False, []
        marked = mark_if_started(store, run, detail)
        return marked, [path for path, _ in remove_paths(stale_temp_paths(store, store.run_dir(run)))]


@dataclass(frozen=True)
class Removal:
    """What ``remove_corrupt`` did with one corrupt artefact."""

    check: ArtefactCheck
    resolved: bool  # True: removed (or replaced meanwhile by an intact one, or already gone)
    note: str  # what was removed, or why nothing was


def _discard(folder: Path) -> None:
    """Remove an artefact folder: renamed out of sight first (a reader sees it whole or not at all;
    a crash mid-way leaves a temp folder for ``retexo store gc``), then deleted."""
    hidden = temp_sibling(folder)
    os.rename(folder, hidden)
    shutil.rmtree(hidden)


def _discard_run_files(folder: Path) -> None:
    """Remove a run's own artefact: its manifest first (the run is then no longer complete), then
    the files directly in its folder. Its layers, events, logs and report stay."""
    (folder / MANIFEST).unlink(missing_ok=True)
    for name in artefact_files(folder, "run"):
        (folder / name).unlink(missing_ok=True)


def _remove_one(store: Store, check: ArtefactCheck) -> Removal:
    """Remove one corrupt artefact; the caller holds its writer lock."""
    if not check.folder.exists():
        return Removal(check, True, "already gone")
    if manifest_stamp(check.folder) != check.manifest_stamp and not check_folder(store, check.folder).corrupt:
        return Removal(check, True, "rewritten meanwhile and now intact: kept")
    if check.kind == "unknown":
        return Removal(check, False, "not a kind of artefact the store knows: kept")
    if check.kind == "run":
        _discard_run_files(check.folder)
        return Removal(check, True, "removed the run's manifest and files (its layers stay)")
    _discard(check.folder)
    return Removal(check, True, "removed")


def remove_corrupt(store: Store, checks: list[ArtefactCheck], wait_seconds: float = 30.0) -> list[Removal]:
    """Remove every corrupt artefact of ``checks`` (``verify_store``) under its writer lock.

    A dataset, partition or layer folder is removed whole; of a run only its own files (manifest,
    comm, metrics, evaluation), so that its layers and history stay and the next ``retexo train``
    of it finalises it again. An artefact that a writer replaced since it was checked is checked
    again and kept when it is now intact; one whose lock stays taken for ``wait_seconds`` is left
    alone (a writer is busy with it). Dependent artefacts are not removed: a partition of a removed
    dataset, or the later layers of a run, are rebuilt or replaced by the next run that needs them.
    """
    removals = []
    for check in (c for c in checks if c.corrupt):
        try:
            with writer_lock(store, check.folder, wait_seconds=wait_seconds):
                removals.append(_remove_one(store, check))
        except StoreError:
            removals.append(Removal(check, False, f"a writer holds its lock (waited {wait_seconds:.0f} s): kept"))
    return removals
