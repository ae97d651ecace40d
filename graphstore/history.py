"""Run history as files: one small JSON per event under ``runs/run=<fp>/events/``.

Events (started, completed, failed, interrupted, ...) are written by the run lifecycle, never
changed, and read by the catalog's ``run_history`` view, so the catalog holds views only.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from graphstore.layout import TMP_PREFIX, Store
from graphstore.manifests import utc_now


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
