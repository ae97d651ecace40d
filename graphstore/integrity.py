"""Checksums of committed artefacts: computing them, checking them, verifying a whole store.

Every manifest lists the files of its artefact with their sha256, size and mtime (``Manifest.files``),
computed by ``graphstore.atomic.commit_directory`` from the temp folder just before the rename
(``folder_digests``); the ranks of a training launch hash the files they wrote themselves
(``record_digests``), so the committing rank never reads another rank's part. What the checksums
cover (``artefact_files``):

- a dataset, partition or layer folder: every file under it except its ``manifest.json``;
- a run folder ``runs/run=<fp>/``: the files directly in it (``comm``, ``metrics``,
  ``evaluation.parquet``) except ``manifest.json``. Its ``layer=<l>/`` folders are artefacts with
  their own manifests, and ``events/``, ``logs/`` and ``report/`` are appended to after the run
  is committed, so they are not covered.

Names starting with ``.tmp-`` (writers' temp files) never belong to an artefact.

Checks, from cheap to thorough:

- ``quick``: deciding whether a stored artefact is kept, skipped or counted as done
  (``atomic_artefact``, ``lookup.existing_dataset`` / ``stored_partition`` / ``layer_fp_of``, hence
  ``runner.plan.layer_state``). A listed file that is missing or has another size is corrupt; one
  whose mtime differs from the recorded one (e.g. a copied store) is hashed and compared; one with
  the recorded size and mtime is trusted. One stat per file: these run several times per command,
  over every layer of a run (hundreds of MB for a 1M-node graph), and what they trust is hashed
  when it is actually read.
- reuse: a layer about to be hard-linked into another run (``lookup.find_layer``,
  ``runs.link_layer``) is hashed in full, since linking puts its bytes into a new artefact. A
  digest this process computed for the same inode, size, mtime and ctime stands in (``_HASHED``),
  so the several reuse checks of one layer read it once.
- read time (``verify_files``): the files a reader is about to use (a worker's ``part=<i>``, its
  earlier-layer embeddings, a warm start's model, the dataset files a partition is built from)
  are hashed in full against the manifest that lists them; a mismatch is a one-line
  ``StoreError`` naming the file and the manifest.
- ``retexo store verify`` (``verify_store``): every artefact, every file hashed in full, and every
  Parquet footer read.

Hashes are streamed (``hashlib.file_digest``), so big files are never loaded into memory.
Manifests without checksums (older stores) are readable but ``unverified``: never treated as
corrupt, never removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.errors import StoreError
from graphstore.layout import MANIFEST, TMP_PREFIX, Store
from graphstore.manifests import FileDigest, Manifest, read_any_manifest, read_manifest
from graphstore.parquet_io import parquet_problem, repair_hint

log = logging.getLogger(__name__)

Level = Literal["quick", "full"]
DIGESTS_DIR = f"{TMP_PREFIX}digests"  # writers' precomputed digests inside a temp folder (never committed)
M = TypeVar("M", bound=Manifest)

# (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) -> sha256 of files hashed by this process, so
# that the several reuse checks of one layer in one run read it once. Any write to the file (or a
# reset of its mtime) changes its ctime, so a rewritten file is never taken for the one hashed.
_HASHED: dict[tuple[int, int, int, int, int], str] = {}
# (manifest path, st_ino, st_size, st_mtime_ns) -> parsed manifest (workers read theirs once).
_MANIFESTS: dict[tuple[str, int, int, int], Manifest] = {}
_WARNED: set[tuple[str, str]] = set()


# --------------------------------------------------------------------------- computing digests


def artefact_files(folder: Path, kind: str) -> list[str]:
    """The files the artefact at ``folder`` consists of: sorted ``/``-separated relative paths
    (see the module docstring: a run covers only the files directly in its folder)."""
    found = folder.iterdir() if kind == "run" else folder.rglob("*")
    names = []
    for path in found:
        relative = path.relative_to(folder)
        if relative.as_posix() == MANIFEST or any(p.startswith(TMP_PREFIX) for p in relative.parts):
            continue
        if path.is_file():
            names.append(relative.as_posix())
    return sorted(names)


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_digest(path: Path) -> FileDigest:
    """sha256 (streamed), size and mtime of one file; remembered for this process's reuse checks."""
    with open(path, "rb") as handle:
        st = os.fstat(handle.fileno())
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    _HASHED[_stat_key(st)] = digest
    return FileDigest(sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns)


def folder_digests(folder: Path, kind: str, known: dict[str, FileDigest] | None = None) -> dict[str, FileDigest]:
    """``FileDigest`` of every file of the artefact at ``folder`` (the manifest's ``files``).

    ``known``: digests computed by the files' writers (``record_digests``), taken as they are
    while the file's size and mtime still match; every other file is hashed here.
    """
    known = known or {}
    digests = {}
    for name in artefact_files(folder, kind):
        st = (folder / name).stat()
        given = known.get(name)
        if given is not None and (given.size, given.mtime_ns) == (st.st_size, st.st_mtime_ns):
            digests[name] = given
        else:
            digests[name] = file_digest(folder / name)
    return digests


def record_digests(folder: Path, names: Iterable[str], label: str) -> None:
    """Hash files a writer just wrote into the temp folder ``folder`` of an artefact (``names``
    relative to it) and leave the digests in ``folder/.tmp-digests/<label>.json`` (fsynced) for
    the commit: a rank hashes its own part, so the committing rank never reads another rank's
    files (residency). The commit takes and removes them (``take_recorded_digests``)."""
    payload = {name: file_digest(folder / name).model_dump() for name in names}
    out = folder / DIGESTS_DIR / f"{label}.json"
    out.parent.mkdir(exist_ok=True)
    with open(out, "w") as handle:
        json.dump(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())


def take_recorded_digests(folder: Path) -> dict[str, FileDigest]:
    """The digests writers recorded in ``folder`` (``record_digests``); their folder is removed."""
    found: dict[str, FileDigest] = {}
    directory = folder / DIGESTS_DIR
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("*.json")):
        found.update({name: FileDigest.model_validate(d) for name, d in json.loads(path.read_text()).items()})
    shutil.rmtree(directory)
    return found


def _sha256(path: Path, st: os.stat_result, cached: bool) -> str:
    """The file's sha256; with ``cached`` a digest this process computed for the same inode, size,
    mtime and ctime is taken instead of reading the file again."""
    if cached and (known := _HASHED.get(_stat_key(st))) is not None:
        return known
    return file_digest(path).sha256


# --------------------------------------------------------------------------- checking one artefact


@dataclass(frozen=True)
class Finding:
    """Something wrong with (or unknown about) one file of an artefact."""

    path: Path  # the file at fault: a listed file, or the manifest
    problem: str  # short, one line
    corrupt: bool = True  # False: only ``unverified`` (no checksums to check against)


def _file_problem(path: Path, recorded: FileDigest, level: Level, cached: bool) -> str | None:
    """Why ``path`` no longer matches ``recorded`` (None when it does, as far as ``level`` checks)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing (listed in the manifest)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != recorded.size:
        return f"changed after it was written ({st.st_size} bytes, {recorded.size} when written)"
    if level == "quick" and st.st_mtime_ns == recorded.mtime_ns:
        return None
    if _sha256(path, st, cached) != recorded.sha256:
        return "changed after it was written (sha256 differs)"
    return None


def _footer_problem(path: Path) -> str | None:
    """Why the Parquet footer of ``path`` cannot be read (None when it can)."""
    try:
        pq.read_metadata(path)
    except FileNotFoundError:
        return "missing"
    except (pa.ArrowException, OSError) as exc:
        return f"corrupt Parquet file ({parquet_problem(exc)})"
    return None


def _reason(exc: StoreError, path: Path) -> str:
    """A ``StoreError`` message without its leading ``<path>: `` and its trailing advice."""
    return str(exc).removeprefix(f"{path}: ").split("; re-run ")[0].split("; run `")[0]


def _check(folder: Path, manifest: Manifest, level: Level, cached: bool, footers: bool) -> list[Finding]:
    """Findings about the files of the artefact at ``folder`` whose manifest is ``manifest``."""
    findings: list[Finding] = []
    if manifest.files is None:
        findings.append(Finding(folder / MANIFEST, "unverified: no checksums (written before they were recorded)",
                                corrupt=False))
        for name in artefact_files(folder, manifest.kind) if footers else []:
            problem = _footer_problem(folder / name) if name.endswith(".parquet") else None
            if problem is not None:
                findings.append(Finding(folder / name, problem))
        return findings
    for name, recorded in sorted(manifest.files.items()):
        problem = _file_problem(folder / name, recorded, level, cached)
        if problem is None and footers and name.endswith(".parquet"):
            problem = _footer_problem(folder / name)
        if problem is not None:
            findings.append(Finding(folder / name, problem))
    return findings


def check_artefact(folder: Path, level: Level = "quick", cached: bool = True, footers: bool = False) -> list[Finding]:
    """Findings about the artefact at ``folder`` (empty: intact, as far as ``level`` checks).

    ``level``: ``quick`` trusts files with the recorded size and mtime, ``full`` hashes every file;
    ``cached`` lets a digest this process already computed for the same inode stand in; ``footers``
    also reads every Parquet footer. An unreadable manifest is one corrupt finding; a manifest
    without checksums one ``unverified`` finding (plus corrupt footers, with ``footers``).
    """
    manifest_path = folder / MANIFEST
    try:
        manifest = read_any_manifest(folder)
    except StoreError as exc:
        return [Finding(manifest_path, f"manifest unreadable: {_reason(exc, manifest_path)}")]
    return _check(folder, manifest, level, cached, footers)


def corruption(folder: Path) -> Finding | None:
    """The first corrupt finding of a ``quick`` check of ``folder`` (None: keep it)."""
    return next((f for f in check_artefact(folder, "quick") if f.corrupt), None)


def intact_manifest(folder: Path, model: type[M], level: Level = "quick", consequence: str | None = None) -> M | None:
    """The manifest of the artefact at ``folder`` when it has one, it is readable as ``model`` and
    its files pass the ``level`` check; else None (with ``consequence``, a warning once per process
    naming the file and what happens instead)."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        manifest = read_manifest(folder, model)
    except StoreError as exc:
        finding = Finding(manifest_path, f"manifest unreadable: {_reason(exc, manifest_path)}")
    else:
        finding = next((f for f in _check(folder, manifest, level, True, False) if f.corrupt), None)
        if finding is None:
            return manifest
    if consequence is not None:
        warn_once(finding, consequence)
    return None


def warn_once(finding: Finding, consequence: str) -> None:
    """Log one warning per process about a corrupt artefact (lookups may meet it several times)."""
    key = (str(finding.path), finding.problem)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s: %s; %s", finding.path, finding.problem, consequence)


# --------------------------------------------------------------------------- read time


def cached_manifest(folder: Path, model: type[M]) -> M:
    """``read_manifest(folder, model)``, parsed once per process while the file is unchanged."""
    path = folder / MANIFEST
    try:
        st = path.stat()
    except FileNotFoundError:
        return read_manifest(folder, model)  # raises the usual 'no manifest' error
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    found = _MANIFESTS.get(key)
    if isinstance(found, model):
        return found
    manifest = read_manifest(folder, model)
    _MANIFESTS[key] = manifest
    return manifest


def mismatch_message(path: Path, manifest_path: Path, problem: str) -> str:
    """The one-line error for a file that no longer matches the manifest listing it."""
    if problem.startswith("missing"):
        return f"{path}: missing, but listed in {manifest_path}; {repair_hint(path)}"
    if not problem.startswith("changed after it was written"):
        return f"{path}: {problem} (listed in {manifest_path}); {repair_hint(path)}"
    detail = problem.removeprefix("changed after it was written").strip(" ()")
    detail = "" if detail == "sha256 differs" else f": {detail}"
    return (f"{path}: contents differ from the checksum in {manifest_path} (changed after it was "
            f"written{detail}); {repair_hint(path)}")


def verify_files(folder: Path, names: Iterable[str], model: type[M]) -> M:
    """The manifest of ``folder`` (as ``model``) after hashing each of ``names`` (relative paths) in
    full against it: a ``StoreError`` naming the first file that differs. Manifests without
    checksums (older stores) are returned unchecked."""
    manifest = cached_manifest(folder, model)
    if manifest.files is None:
        return manifest
    for name in names:
        path = folder / name
        recorded = manifest.files.get(name)
        if recorded is None:
            raise StoreError(f"{path}: not listed in {folder / MANIFEST}; {repair_hint(path)}")
        problem = _file_problem(path, recorded, "full", cached=False)
        if problem is not None:
            raise StoreError(mismatch_message(path, folder / MANIFEST, problem))
    return manifest


def verify_digests(folder: Path, recorded: dict[str, FileDigest], reported: Path) -> None:
    """Hash the files of ``folder`` against ``recorded`` (a manifest's ``files``; this process's
    digests of the same inodes count); a ``StoreError`` naming the file under ``reported`` (the
    folder the digests belong to) on the first difference."""
    for name, digest in sorted(recorded.items()):
        problem = _file_problem(folder / name, digest, "full", cached=True)
        if problem is not None:
            raise StoreError(mismatch_message(reported / name, reported / MANIFEST, problem))


# --------------------------------------------------------------------------- the whole store


@dataclass(frozen=True)
class ArtefactCheck:
    """The result of verifying one artefact folder."""

    kind: str  # dataset | partition | layer | run | unknown (from the path when the manifest is unreadable)
    folder: Path
    findings: list[Finding] = field(default_factory=list)
    manifest_stamp: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of the manifest when checked
    bytes: int = 0  # bytes of the files checked

    @property
    def corrupt(self) -> bool:
        return any(f.corrupt for f in self.findings)

    @property
    def unverified(self) -> bool:
        return any(not f.corrupt for f in self.findings)


def kind_of(store: Store, folder: Path) -> str:
    """The artefact kind a folder's place in the store implies."""
    parts = folder.relative_to(store.root).parts
    if parts and parts[0] == "datasets":
        return "dataset"
    if parts and parts[0] == "partitions":
        return "partition"
    if parts and parts[0] == "runs":
        return "layer" if len(parts) >= 3 and parts[2].startswith("layer=") else "run"
    return "unknown"


def manifest_stamp(folder: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns) of the folder's manifest: changes whenever a writer replaces it."""
    try:
        st = (folder / MANIFEST).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def artefact_folders(store: Store) -> list[Path]:
    """Every folder with a ``manifest.json``, outside writers' temp folders, sorted."""
    folders = []
    for path in sorted(store.root.glob(f"**/{MANIFEST}")):
        if not any(part.startswith(TMP_PREFIX) for part in path.relative_to(store.root).parts):
            folders.append(path.parent)
    return folders


def check_folder(store: Store, folder: Path) -> ArtefactCheck:
    """Verify one artefact in full: every listed file hashed afresh, every Parquet footer read."""
    stamp = manifest_stamp(folder)
    findings = check_artefact(folder, "full", cached=False, footers=True)
    try:
        manifest = read_any_manifest(folder)
        kind = manifest.kind
        names = list(manifest.files) if manifest.files is not None else artefact_files(folder, kind)
    except StoreError:
        kind, names = kind_of(store, folder), []
    size = sum((folder / n).stat().st_size for n in names if (folder / n).is_file())
    return ArtefactCheck(kind, folder, findings, stamp, size)


def verify_store(store: Store) -> list[ArtefactCheck]:
    """``check_folder`` of every artefact of the store (datasets, partitions, runs and layers)."""
    checks = [check_folder(store, folder) for folder in artefact_folders(store)]
    order = {"dataset": 0, "partition": 1, "run": 2, "layer": 3}
    return sorted(checks, key=lambda c: (order.get(c.kind, 9), str(c.folder)))
