"""The promotion gate's records: one JSON file per decision under ``pipelines/name=<p>/decisions/``.

A pipeline (a named scheduled job) has at most one promoted model at a time: the ``promoted_run``
of its newest decision. A decision is never changed; the catalog's ``promotions`` view reads them
all, and ``current_predictions`` follows each pipeline's newest ``serving_run``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from graphstore.errors import StoreError
from graphstore.history import append_record
from graphstore.layout import NAME_PATTERN, TMP_PREFIX, Store
from graphstore.lookup import completed_run
from graphstore.manifests import utc_now

Decision = Literal["promoted", "refused", "kept"]


class PromotionOptions(BaseModel):
    """The gate of a scheduled pipeline (off unless ``pipeline`` is given)."""

    pipeline: str | None = Field(None, pattern=NAME_PATTERN,
                                 description="Name the promoted model is kept under (letters, digits, - _ .); "
                                 "none = no gate.")
    tolerance: float = Field(0.005, ge=0, le=1, description="A new run is promoted when its validation accuracy "
                             "is at least the promoted model's (re-evaluated on the new data) minus this.")
    warm_start: bool = Field(False, description="Start training from the promoted model's parameters when the "
                             "data changed since it was trained.")


class PromotionRecord(BaseModel):
    """One decision of the gate.

    ``decision``: ``promoted`` (the candidate is now the pipeline's model), ``refused`` (it was
    worse by more than the tolerance; the incumbent stays) or ``kept`` (the candidate is the
    promoted run itself: nothing changed). ``incumbent_val_acc`` is the incumbent's validation
    accuracy on the candidate's dataset version, from ``incumbent_evaluation_run``.
    ``serving_run`` is the run whose predictions ``current_predictions`` shows: the candidate when
    promoted, else the incumbent's evaluation on the new data.
    """

    pipeline: str
    decision: Decision
    run: str
    dataset: str
    val_acc: float
    incumbent: str | None
    incumbent_val_acc: float | None
    incumbent_evaluation_run: str | None
    tolerance: float
    promoted_run: str
    serving_run: str
    reason: str
    decided_at: str = Field(default_factory=utc_now)


def decisions_dir(store: Store, pipeline: str) -> Path:
    return store.root / "pipelines" / f"name={pipeline}" / "decisions"


def record_decision(store: Store, record: PromotionRecord) -> None:
    """Append one decision (a new file, written atomically)."""
    append_record(decisions_dir(store, record.pipeline), record.decided_at, record.decision, record.model_dump())


def latest_decision(store: Store, pipeline: str) -> PromotionRecord | None:
    """The pipeline's newest decision, or None before its first run."""
    files = sorted(p for p in decisions_dir(store, pipeline).glob("*.json") if not p.name.startswith(TMP_PREFIX))
    if not files:
        return None
    try:
        return PromotionRecord.model_validate_json(files[-1].read_text())
    except ValueError as exc:
        raise StoreError(f"{files[-1]}: corrupt promotion record ({exc})") from None


def passes_gate(val_acc: float, incumbent_val_acc: float, tolerance: float) -> bool:
    """The rule: promote when the candidate is at most ``tolerance`` below the incumbent."""
    return val_acc >= incumbent_val_acc - tolerance


def warm_start_for(store: Store, pipeline: str, dataset_fp: str) -> str | None:
    """The run a pipeline's new training starts from: the promoted model when the data changed
    since it was trained; on the promoted model's own data, whatever that model started from (so
    an unchanged source plans the same run and is fully cached). None before the first promotion."""
    current = latest_decision(store, pipeline)
    if current is None:
        return None
    promoted = completed_run(store, current.promoted_run)
    if promoted.dataset == dataset_fp:
        return promoted.config.get("warm_start")  # type: ignore[return-value]
    return promoted.fp
