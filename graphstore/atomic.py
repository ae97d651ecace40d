"""Crash-safe writes: temp sibling folder, fsync, rename; manifest last; one writer per artefact.

A reader sees an artefact only when ``<dir>/manifest.json`` exists, and the manifest is written
inside the temp folder just before the rename, so a crash at any point leaves either nothing or
a complete artefact. Leftover ``.tmp-*`` folders are invisible and removed by ``retexo store gc``.

``commit_directory`` is the one place where artefact folders are committed (datasets, partitions,
layers; a run's own files are written by ``runner.finalize`` with ``atomic_write_file``), and it
records the sha256, size and mtime of every file of the folder in the manifest's ``files``
(``graphstore.integrity``). ``atomic_artefact`` keeps an existing target only when it passes the
quick integrity check; a target with an unreadable manifest or changed files is replaced (with
a warning naming the file), so re-running the command that wrote a corrupt artefact repairs it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import IO
from contextlib import contextmanager
from pathlib import Path

from graphstore.errors import StoreError
from graphstore.integrity import corruption, folder_digests, take_recorded_digests
from graphstore.layout import MANIFEST, TMP_PREFIX, Store, is_complete
from graphstore.manifests import Manifest, manifest_json

log = logging.getLogger(__name__)


def _lock_path(store: Store, target: Path) -> Path:
    key = str(target.resolve().relative_to(store.root))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    store.lock_dir.mkdir(parents=True, exist_ok=True)
    return store.lock_dir / f"{digest}.lock"


def flock_within(handle: IO[str], seconds: float, poll_s: float = 0.05) -> bool:
    """Take an exclusive ``flock`` on the open file ``handle``, trying for up to ``seconds``;
    False when another process still holds it (shared or exclusive) by then."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


@contextmanager
def writer_lock(store: Store, target: Path, wait_seconds: float = 600.0) -> Iterator[None]:
    """Exclusive lock on one artefact path (flock on a file under ``.locks``), across processes."""
    path = _lock_path(store, target)
    with open(path, "a+") as handle:
        if not flock_within(handle, wait_seconds, poll_s=0.1):
            raise StoreError(f"another writer holds the lock on {target} (waited {wait_seconds:.0f} s)")
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def lock_is_free(store: Store, target: Path) -> bool:
    """True when no process holds the writer lock of ``target`` right now."""
    with open(_lock_path(store, target), "a+") as handle:
        if not flock_within(handle, 0):
            return False
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return True


def fsync_file(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories themselves."""
    for current, _dirs, files in os.walk(path):
        for name in files:
            fsync_file(Path(current, name))
        fsync_file(Path(current))


def temp_sibling(target: Path) -> Path:
    """A fresh hidden folder next to ``target``; globs over ``key=*`` never match it."""
    return target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def commit_directory(temp: Path, target: Path, manifest: Manifest, contents_synced: bool = False) -> None:
    """Write the manifest into ``temp`` (last), fsync, rename ``temp`` to ``target``.

    The manifest's ``files`` are the digests of the files in ``temp``: computed here (streamed),
    or by the files' writers (``graphstore.integrity.record_digests``: each rank its own part), or
    given by the caller (``graphstore.runs.link_layer``: the verified digests of the linked files).
    The caller holds the writer lock of ``target`` (possibly in a parent process). With
    ``contents_synced`` the writers of the files already fsynced them (each worker its own part),
    so only the manifest and the folder are synced here. A folder at ``target`` (a foreign
    or damaged leftover, or a corrupt artefact being rebuilt) is replaced.
    """
    known = take_recorded_digests(temp)
    if manifest.files is None:
        manifest = manifest.model_copy(update={"files": folder_digests(temp, manifest.kind, known)})
    (temp / MANIFEST).write_text(manifest_json(manifest))
    if contents_synced:
        fsync_file(temp / MANIFEST)
        fsync_file(temp)
    else:
        fsync_tree(temp)
    replaced = None
    if target.exists():  # moved aside first: a crash now leaves a temp folder for `retexo store gc`
        replaced = temp_sibling(target)
        os.rename(target, replaced)
    os.rename(temp, target)
    fsync_file(target.parent)
    if replaced is not None:
        shutil.rmtree(replaced)


class ArtefactWriter:
    """Collects files in a temp folder; ``commit`` writes the manifest and renames into place."""

    def __init__(self, store: Store, target: Path):
        self.store = store
        self.target = target
        self.path = temp_sibling(target)
        self.manifest: Manifest | None = None

    def commit(self) -> None:
        if self.manifest is None:
            raise StoreError(f"{self.target}: the writer set no manifest")
        commit_directory(self.path, self.target, self.manifest)


@contextmanager
def atomic_artefact(store: Store, target: Path) -> Iterator[ArtefactWriter]:
    """Write an artefact folder atomically under its writer lock.

    The caller fills ``writer.path`` and ``writer.manifest``; on normal exit the manifest is
    written last and the folder renamed to ``target``. On any exception the temp folder is removed
    and ``target`` is untouched. If another writer completed ``target`` first, it is kept, unless
    it fails the quick integrity check (an unreadable manifest, a listed file missing or changed):
    then it is replaced, with a warning naming the file.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(store, target):
        writer = ArtefactWriter(store, target)
        writer.path.mkdir()
        try:
            yield writer
            complete = is_complete(target)
            problem = corruption(target) if complete else None
            if complete and problem is None:
                shutil.rmtree(writer.path)
            else:
                if problem is not None:
                    log.warning("replacing the corrupt artefact %s (%s: %s)", target, problem.path, problem.problem)
                writer.commit()
        except BaseException:
            shutil.rmtree(writer.path, ignore_errors=True)
            raise


def atomic_write_file(store: Store, path: Path, data: bytes) -> None:
    """Replace one file atomically under its writer lock (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(store, path):
        tmp = temp_sibling(path)
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(tmp, path)
        fsync_file(path.parent)
