"""Run history as files: one small JSON per event under ``runs/run=<fp>/events/``.

Events (started, completed, failed, interrupted, ...) are written by the run lifecycle, never
changed, and read by the catalog's ``run_history`` view, so the catalog holds views only. A run's
status is its last event.

A run is never left ``started`` for good: while a process trains a run it holds a shared flock
on the run's lock file (``.locks/run-<fp>.lock``, ``hold_run``), and so do the worker processes
of its launch. A run whose last event is ``started`` while nobody holds that lock lost its launcher
(killed, machine lost): the launcher's guard (``runner.descendant_guard``, as soon as the launcher
and its workers are gone), the next run of it and ``retexo store gc`` record ``interrupted`` for it
(``mark_abandoned``). The check takes the lock exclusively (``run_unheld``), so it never races a
launcher that is recording its own last event, nor a worker that is still writing.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from graphstore.atomic import flock_within
from graphstore.layout import TMP_PREFIX, Store
from graphstore.manifests import utc_now

ABANDONED = "abandoned: its launcher is gone"


def append_record(folder: Path, happened_at: str, label: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as a new JSON file ``<time>-<random>-<label>.json`` in ``folder``
    (atomically: a temp file renamed); names sort by ``happened_at``. Used by run events and by
    promotion decisions (``graphstore.promotion``)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{happened_at.replace(':', '').replace('+', 'Z')}-{uuid.uuid4().hex[:8]}-{label}.json"
    temp = folder / f"{TMP_PREFIX}{name}"
    temp.write_text(json.dumps(payload) + "\n")
    os.rename(temp, folder / name)
    return folder / name


def record_run_event(store: Store, run: str, event: str, detail: str = "") -> None:
    """Append one event to the run's history."""
    happened_at = utc_now()
    append_record(store.run_dir(run) / "events", happened_at, event,
                  {"run": run, "event": event, "happened_at": happened_at, "detail": detail})


def last_event(store: Store, run: str) -> dict[str, Any] | None:
    """The newest event of ``run`` (its ``run``, ``event``, ``happened_at``, ``detail``), or None."""
    folder = store.run_dir(run) / "events"
    names = [p.name for p in folder.glob("*.json") if not p.name.startswith(TMP_PREFIX)] if folder.is_dir() else []
    if not names:
        return None
    return json.loads((folder / max(names)).read_text())  # names sort by happened_at (microseconds)


def run_lock_path(store: Store, run: str) -> Path:
    """The lock file that the process training ``run`` holds (shared) while it trains."""
    store.lock_dir.mkdir(parents=True, exist_ok=True)
    return store.lock_dir / f"run-{run}.lock"


@contextmanager
def hold_run(store: Store, run: str) -> Iterator[None]:
    """Hold the run's lock (shared: identical runs may train side by side) while training it: the
    launcher, and each worker process of its launch for its whole life. The kernel drops the lock
    when the process dies, however it dies."""
    with open(run_lock_path(store, run), "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextmanager
def run_unheld(store: Store, run: str, wait_s: float = 0.0) -> Iterator[bool]:
    """Take the run's lock exclusively, which succeeds only while no process holds the run
    (``hold_run``), trying for up to ``wait_s`` seconds; yields whether it did. While it is
    taken, nobody can start training the run."""
    with open(run_lock_path(store, run), "a+") as handle:
        if not flock_within(handle, wait_s):
            yield False  # somebody is training the run right now
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def mark_if_started(store: Store, run: str, detail: str) -> bool:
    """Record ``interrupted`` (with ``detail``) if the run's last event is ``started``; True when
    it did. The caller holds ``run_unheld``."""
    last = last_event(store, run)
    if last is None or last["event"] != "started":
        return False
    record_run_event(store, run, "interrupted", detail)
    return True


def mark_abandoned(store: Store, run: str, detail: str = ABANDONED, wait_s: float = 0.0) -> bool:
    """Record ``interrupted`` (with ``detail``) for ``run`` if its last event is ``started`` and no
    process holds the run (``hold_run``); True when it did. ``wait_s``: keep trying this long (s)
    to take the run's lock, for a caller that knows its holders are dying right now."""
    with run_unheld(store, run, wait_s) as unheld:
        return unheld and mark_if_started(store, run, detail)


def mark_abandoned_runs(store: Store) -> list[str]:
    """``mark_abandoned`` for every run of the store; the runs it marked ``interrupted``."""
    marked = []
    for folder in sorted((store.root / "runs").glob("run=*")):
        run = folder.name.removeprefix("run=")
        last = last_event(store, run)
        if last is not None and last["event"] == "started" and mark_abandoned(store, run):
            marked.append(run)
    return marked
