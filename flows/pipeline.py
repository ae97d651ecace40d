"""``pipeline_flow``: ingest -> partition -> train (every pending layer in one launch) -> report
[-> promotion gate].

One flow calling the tasks directly (no subflows). Every stage is cached by its store
fingerprint: a second identical run recomputes nothing and reports each stage as cached; a run
that failed resumes at the first unfinished layer. With ``promotion.pipeline`` set, the new run is
judged against the pipeline's promoted model (``tasks.promote``); a refused run ends the flow run
in state Failed (its summary is the state's data), so a scheduled retraining that did not deliver
a model is visible as such. A Prefect API lost meanwhile stops none of this work (artifacts are
best-effort, ``tasks.best_effort``); what the flow completed is noted for the command to say
(``flows.local_run.note_outcome``).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import Failed, State

from flows.params import PipelineParams, RunParams
from flows.local_run import note_outcome, untagged_tasks
from flows.train import train_and_report
from graphstore.layout import Store
from graphstore.lookup import completed_run
from graphstore.promotion import warm_start_for
from retexo_core.config import TrainConfig
from tasks.ingest import ingest_task
from tasks.partition import partition_task
from tasks.promote import promote_task


def with_pipeline_warm_start(params: PipelineParams, run: RunParams) -> RunParams:
    """``run`` starting from the pipeline's promoted model (``promotion.warm_start``) when that
    model fits this run; a cold start, with a warning, when it does not (``prepare_run``)."""
    store = Store.open(run.store)
    warm = warm_start_for(store, str(params.promotion.pipeline), run.dataset)
    train = TrainConfig.model_validate({**run.train.model_dump(), "warm_start": warm})
    if warm is not None and run.train.chooses_depth:  # the promoted model's depth, chosen when it trained
        train = train.at_depth(completed_run(store, warm).config["layers"])
        get_run_logger().info("choose_depth: warm start from the promoted model, at its depth (%s layers)",
                              train.layers)
    return run.model_copy(update={"train": train, "cold_start_if_unfit": True})


def completed_text(store_root: str, summary: dict[str, object]) -> str:
    """What the pipeline completed, in one clause: the run, where it is, its report."""
    run = str(summary["run"])
    text = f"the pipeline completed: run {run} is in {Store(Path(store_root)).run_dir(run)} (report {summary['report']})"
    if "promotion" in summary:
        text += f", promotion gate: {summary['promotion']['decision']}"  # type: ignore[index]
    return text


@flow(name="pipeline")
def pipeline_flow(params: PipelineParams) -> dict[str, object] | State:
    with untagged_tasks():
        return run_pipeline(params)


def run_pipeline(params: PipelineParams) -> dict[str, object] | State:
    """The pipeline flow's body (see the module docstring)."""
    logger = get_run_logger()
    store_root = str(Store.open(params.store).root)
    dataset = ingest_task(store_root, params.dataset)  # type: ignore[arg-type]
    stages: dict[str, str] = {"ingest": str(dataset["status"])}
    if not params.train.strategy_spec.whole_graph:
        partition = partition_task(store_root, str(dataset["fp"]), params.partition, params.train.force)
        stages["partition"] = str(partition["stage"])
    run = params.run_params(str(dataset["fp"]))
    gate = params.promotion
    if gate.pipeline and gate.warm_start:
        run = with_pipeline_warm_start(params, run)
    result = train_and_report(run, params.compare)
    stages.update(result["stages"])  # type: ignore[arg-type]
    summary: dict[str, object] = {
        "run": result["run"], "stages": stages, "test_acc": result["test_acc"], "total_bytes": result["total_bytes"],
        "report": result["report"], "plot": result["plot"], "dataset": dataset["fp"], "compared": result["compared"]}
    if gate.pipeline:
        decision = promote_task(run.request(), gate, str(result["run"]))
        stages["promote"] = str(decision["decision"])
        summary["promotion"] = decision
    for stage, status in stages.items():
        logger.info("%-10s %s", stage, status)
    note_outcome(completed_text(store_root, summary))
    if stages.get("promote") == "refused":
        return Failed(message=f"not promoted: {summary['promotion']['reason']}", data=summary)  # type: ignore[index]
    return summary
