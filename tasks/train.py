"""Training and reporting tasks. One task owns a whole run: every pending layer is trained in one
launch of the process group (the lifecycle in ``runner.lifecycle``), and the flow hears of each
layer as it is committed (a progress artifact and a log line per layer). A process that shows the
run (the command line: one progress bar per layer from rank 0's rounds) hands its display to
``show_training_with``; tasks draw nothing themselves. Every rank's log stays in ``runs/run=<fp>/logs/rank-<i>.log``,
out of the console and the flow log. A retried task resumes from the store at the first
unfinished layer. Artifacts are best-effort (``tasks.best_effort``): a lost Prefect API never
fails the training, which completes and is finalised from the store."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from graphstore.layout import is_complete
from graphstore.report import write_report
from runner.depth import depth_choice
from runner.lifecycle import LayerProgress, OnLayer, OnRound, run_training
from runner.plan import RunPlan, layer_state
from tasks.best_effort import report


TrainingDisplay = Callable[[], AbstractContextManager[tuple[OnLayer, OnRound]]]  # yields (on_layer, on_round)


@contextmanager
def no_display() -> Iterator[tuple[OnLayer, OnRound]]:
    yield (lambda item: None), (lambda item: None)


display: TrainingDisplay = no_display


def show_training_with(shown_by: TrainingDisplay) -> None:
    """How ``train_task`` shows a run's progress in this process from now on (nothing by default:
    a deployment's worker has the task's log lines and progress artifact)."""
    global display
    display = shown_by


@task(name="train", cache_policy=NO_CACHE)
def train_task(plan: RunPlan) -> dict[str, object]:
    """Bring every layer of the run into the store and finalise the run.

    Returns the run fingerprint, each layer's status (trained, reused, cached) and the
    evaluation stage's status (done, or cached when the run was already complete).
    """
    logger = get_run_logger()
    already = all(is_complete(p.store.run_dir(p.run_fp)) and all(layer_state(p, l) == "done" for l in p.layers)
                  for p in (plan, plan.deeper) if p is not None)
    progress_id = report(create_progress_artifact, 0.0, key=f"train-progress-{plan.run_fp}",
                         description=f"layers finished of run {plan.run_fp}")

    layers = plan.config.layers + (0 if plan.deeper is None else plan.deeper.config.layers)
    finished: list[LayerProgress] = []
    with display() as (show_layer, show_round):
        def on_layer(item: LayerProgress) -> None:
            finished.append(item)
            if progress_id is not None:
                report(update_progress_artifact, progress_id, 100.0 * len(finished) / layers)
            logger.info("layer %s: %s (%.1f s)", item.name, item.state, item.seconds)
            show_layer(item)

        summary, progress = run_training(plan, on_layer=on_layer, on_round=show_round)
    assert summary is not None
    total_bytes = summary.total_bytes
    result: dict[str, object] = {}
    if plan.deeper is not None:
        choice = depth_choice(plan)
        logger.info("%s", choice.describe())
        total_bytes = choice.total_bytes
        result["depth"] = {"kept": len(summary.layers), "runs": {len(m.layers): m.fp for m in (choice.shallower,
                                                                                               choice.deeper)}}
    logger.info("run %s: test accuracy %.4f, %d bytes", summary.fp, summary.accuracy("test"), total_bytes)
    return {"run": summary.fp, "layers": {p.name: p.state for p in progress},
            "evaluate": "cached" if already else "done", "test_acc": summary.test_acc,
            "total_bytes": total_bytes, **result}


@task(name="report", cache_policy=NO_CACHE)
def report_task(plan: RunPlan, run: str) -> dict[str, object]:
    """Markdown report of ``run`` (the plan's, or the depth it kept: ``train_task``'s ``run``), with
    the accuracy-vs-bytes plot inline, and a metrics table artifact; the report in the store is
    redrawn only when a run on the same dataset finished after it."""
    written = write_report(plan.store, run, only_if_stale=True)
    image = base64.b64encode(written.plot_path.read_bytes()).decode()
    markdown = written.markdown.replace("(accuracy_vs_bytes.png)", f"(data:image/png;base64,{image})")
    report(create_markdown_artifact, markdown, key=f"run-report-{run}", description=f"run {run}")
    m = written.manifest
    report(
        create_table_artifact,
        [{"run": run, "dataset": m.dataset_name, "strategy": m.label, "model": m.model,
          "parts": m.parts, "split": r["split"], "accuracy": r["accuracy"], "macro_f1": r["macro_f1"],
          "total_bytes": m.total_bytes, "sim_comm_s": m.sim_comm_s} for r in m.evaluation],
        key=f"run-metrics-{run}", description="metrics per split",
    )
    get_run_logger().info("report written to %s (plot %s)", written.report_path, written.plot_path)
    return {"report": str(written.report_path), "plot": str(written.plot_path)}
