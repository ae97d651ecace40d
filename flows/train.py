"""``train_flow``: train (or reuse) every layer of a run over a stored, partitioned dataset, finalise
it and publish its report. The pipeline calls the same tasks."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import flow

from flows.params import RunParams
from graphstore.errors import StoreError
from graphstore.layout import Store
from graphstore.lookup import find_dataset, find_partition
from runner.plan import RunPlan, plan_run
from tasks.train import report_task, train_task


def plan_for(params: RunParams) -> RunPlan:
    """The run's plan; the partition must already be in the store (``partition_flow``)."""
    store = Store.open(params.store)
    dataset = find_dataset(store, params.dataset)
    partition = None
    if params.train.strategy != "centralized":
        partition = find_partition(store, dataset, params.partition)
        if partition is None:
            raise StoreError(f"dataset {dataset.name} has no {params.partition.method} partition into "
                             f"{params.partition.parts} parts yet: run the partition flow first")
    return plan_run(store, dataset, partition, params.train, params.network)


def train(params: RunParams, plan: RunPlan) -> dict[str, object]:
    """The train task of ``plan`` with the retries of ``params``."""
    return train_task.with_options(retries=params.retries, retry_delay_seconds=params.retry_delay_s)(plan)


def train_and_report(params: RunParams, baselines: Sequence[RunParams] = ()) -> dict[str, object]:
    """The train task, then the ``baselines`` (the same task each), then the report task, whose
    accuracy-vs-bytes plot therefore shows the run next to its baselines. Returns the run's
    summary with every stage's status and ``compared``: the baselines' run fingerprints."""
    plan = plan_for(params)
    trained = train(params, plan)
    stages = {f"layer {layer}": state for layer, state in trained["layers"].items()}  # type: ignore[union-attr]
    stages["evaluate"] = trained["evaluate"]  # type: ignore[assignment]
    compared = []
    for baseline in baselines:
        result = train(baseline, plan_for(baseline))
        fresh = any(state != "cached" for state in result["layers"].values())  # type: ignore[union-attr]
        stages[f"compare {baseline.train.strategy}"] = "trained" if fresh else "cached"
        compared.append(str(result["run"]))
    report = report_task(plan)
    return {**trained, **report, "stages": stages, "compared": compared}


@flow(name="train")
def train_flow(params: RunParams) -> dict[str, object]:
    return train_and_report(params)
