"""``train_flow``: train (or reuse) every layer of a run over a stored, partitioned dataset, finalise
it and publish its report. The pipeline calls the same tasks."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import flow, get_run_logger

from flows.params import RunParams
from retexo_core.config import Strategy
from runner.plan import RunPlan
from runner.request import prepare_run
from tasks.train import report_task, train_task


def train(params: RunParams, plan: RunPlan) -> dict[str, object]:
    """The train task of ``plan`` with the retries of ``params``."""
    return train_task.with_options(retries=params.retries, retry_delay_seconds=params.retry_delay_s)(plan)


def train_and_report(params: RunParams, baselines: Sequence[Strategy] = ()) -> dict[str, object]:
    """The train task, then the run with each of the ``baselines`` strategies instead
    (``RunRequest.baseline``, at the depth the run kept when it chose one; the same task each),
    then the report task, whose accuracy-vs-bytes plot therefore shows the run next to its
    baselines. The partition must already be in the store (``partition_flow``). Returns the run's
    summary with every stage's status and ``compared``: the baselines' run fingerprints."""
    request = params.request()
    plan = prepare_run(request, partitions="stored", warn=get_run_logger().warning)
    trained = train(params, plan)
    stages = {f"layer {layer}": state for layer, state in trained["layers"].items()}  # type: ignore[union-attr]
    stages["evaluate"] = trained["evaluate"]  # type: ignore[assignment]
    compared = []
    kept = trained.get("depth", {}).get("kept")  # type: ignore[union-attr]
    for strategy in baselines:
        result = train(params, prepare_run(request.baseline(strategy, kept), partitions="stored"))
        fresh = any(state != "cached" for state in result["layers"].values())  # type: ignore[union-attr]
        stages[f"compare {strategy}"] = "trained" if fresh else "cached"
        compared.append(str(result["run"]))
    report = report_task(plan, str(trained["run"]))
    return {**trained, **report, "stages": stages, "compared": compared}


@flow(name="train")
def train_flow(params: RunParams) -> dict[str, object]:
    return train_and_report(params)
