"""Run history as files: one small JSON per event under ``runs/run=<fp>/events/``.

Events (started, completed, failed, interrupted, ...) are written by the run lifecycle, never
changed, and read by the catalog's ``run_history`` view, so the catalog holds views only.
"""

from __future__ import annotations

import json
import os
import uuid

from graphstore.layout import TMP_PREFIX, Store
from graphstore.manifests import utc_now


def record_run_event(store: Store, run: str, event: str, detail: str = "") -> None:
    """Append one event to the run's history (a new file, written atomically)."""
    folder = store.run_dir(run) / "events"
    folder.mkdir(parents=True, exist_ok=True)
    happened_at = utc_now()
    name = f"{happened_at.replace(':', '').replace('+', 'Z')}-{uuid.uuid4().hex[:8]}-{event}.json"
    temp = folder / f"{TMP_PREFIX}{name}"
    temp.write_text(json.dumps({"run": run, "event": event, "happened_at": happened_at, "detail": detail}) + "\n")
    os.rename(temp, folder / name)
