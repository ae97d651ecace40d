"""The promotion gate of a scheduled pipeline: judge a new run against the promoted model on the
same (new) data, record the decision, and explain it in a markdown artifact.

The incumbent is re-evaluated by an evaluation run: its own configuration with ``warm_start`` =
itself and 0 rounds / epochs, over the new dataset version's partition. That run is an ordinary
run in the store (cached, with its bytes logged and its predictions on the new nodes).
"""

from __future__ import annotations

import re
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from graphstore.layout import Store
from graphstore.lookup import completed_run
from graphstore.manifests import RunManifest, utc_now
from graphstore.promotion import PromotionOptions, PromotionRecord, latest_decision, passes_gate, record_decision
from retexo_core.config import TrainConfig
from retexo_core.strategies.registry import spec
from runner.lifecycle import run_training
from runner.request import RunRequest, prepare_run
from tasks.best_effort import report


def evaluate_incumbent(params: RunRequest, incumbent: RunManifest) -> RunManifest:
    """The incumbent model's metrics on ``params.dataset``: its layers as they are, 0 rounds (the
    partition is the new run's, already stored)."""
    config = TrainConfig.model_validate({**incumbent.config, "warm_start": incumbent.fp, "rounds": 0, "epochs": 0,
                                         "patience": None, "timeout_s": params.train.timeout_s})
    summary, _ = run_training(prepare_run(params.model_copy(update={"train": config, "cold_start_if_unfit": False}),
                                          partitions="stored"))
    assert summary is not None
    return summary


def val_score(run: RunManifest) -> float:
    """What the gate compares: the validation ROC-AUC for a link or two-class task, else the
    validation accuracy (the score model selection maximised; 0 when there is none)."""
    value = run.score("val") if run.evaluation else float("nan")
    return value if value == value else 0.0


def decide(params: RunRequest, gate: PromotionOptions, candidate: RunManifest) -> PromotionRecord:
    """Apply the gate's rule to ``candidate`` (see ``graphstore.promotion``)."""
    store = Store.open(params.store)
    pipeline = str(gate.pipeline)
    current = latest_decision(store, pipeline)
    common: dict[str, Any] = dict(pipeline=pipeline, run=candidate.fp, dataset=candidate.dataset,
                                  val_acc=val_score(candidate), tolerance=gate.tolerance)
    if current is None:
        return PromotionRecord(**common, decision="promoted", incumbent=None, incumbent_val_acc=None,
                               incumbent_evaluation_run=None, promoted_run=candidate.fp, serving_run=candidate.fp,
                               reason="first run of the pipeline")
    if current.promoted_run == candidate.fp:
        return current.model_copy(update={**common, "decision": "kept", "decided_at": utc_now(),
                                          "reason": "the promoted model is this run: nothing changed"})
    incumbent = completed_run(store, current.promoted_run)
    if spec(incumbent.strategy).warm_startable:
        evaluation = evaluate_incumbent(params, incumbent)
        old_acc, evaluation_run, where = val_score(evaluation), evaluation.fp, "re-evaluated on this data"
    else:  # tma / grappa models cannot be loaded into a run: compare with what they scored on their data
        old_acc, evaluation_run, where = val_score(incumbent), None, "as recorded on its own data"
    promoted = passes_gate(common["val_acc"], old_acc, gate.tolerance)
    verdict = ">=" if promoted else "<"
    reason = (f"val {candidate.score_name('val')} {common['val_acc']:.4f} {verdict} {old_acc:.4f} - {gate.tolerance:g} "
              f"(promoted run {incumbent.fp}, {where})")
    return PromotionRecord(**common, decision="promoted" if promoted else "refused", incumbent=incumbent.fp,
                           incumbent_val_acc=old_acc, incumbent_evaluation_run=evaluation_run,
                           promoted_run=candidate.fp if promoted else incumbent.fp,
                           serving_run=candidate.fp if promoted else evaluation_run or incumbent.fp, reason=reason)


def decision_markdown(record: PromotionRecord) -> str:
    rows = [("decision", record.decision), ("candidate run", record.run), ("dataset version", record.dataset),
            ("candidate val score (accuracy, or ROC-AUC: links, two classes)", f"{record.val_acc:.4f}"), ("promoted run before", record.incumbent or "none"),
            ("its val score on this data", "" if record.incumbent_val_acc is None else f"{record.incumbent_val_acc:.4f}"),
            ("tolerance", f"{record.tolerance:g}"), ("promoted run now", record.promoted_run),
            ("predictions served from", record.serving_run)]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"# Promotion gate of pipeline `{record.pipeline}`: {record.decision}\n\n{record.reason}.\n\n"
            f"| | |\n|---|---|\n{table}\n\nQuery it with `retexo sql \"SELECT * FROM promotions\"`; the "
            "served predictions are in the `current_predictions` view.\n")


@task(name="promote", cache_policy=NO_CACHE)
def promote_task(params: RunRequest, gate: PromotionOptions, run: str) -> dict[str, object]:
    """Decide, record and explain; returns the record as a dict."""
    store = Store.open(params.store)
    record = decide(params, gate, completed_run(store, run))
    record_decision(store, record)
    key = "promotion-" + re.sub(r"[^a-z0-9-]", "-", record.pipeline.lower())
    report(create_markdown_artifact, decision_markdown(record), key=key,
           description=f"promotion gate: {record.decision}")
    get_run_logger().info("promotion gate of %s: %s (%s)", record.pipeline, record.decision, record.reason)
    return record.model_dump()
