"""``train_flow``: train (or reuse) every layer of a run over a stored, partitioned dataset, finalise
it and publish its report. The pipeline calls the same tasks."""

from __future__ import annotations

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


def train_and_report(params: RunParams) -> dict[str, object]:
    """The train task (with the retries of ``params``) and the report task; the stages' statuses."""
    plan = plan_for(params)
    trained = train_task.with_options(retries=params.retries, retry_delay_seconds=params.retry_delay_s)(plan)
    report = report_task(plan)
    stages = {f"layer {layer}": state for layer, state in trained["layers"].items()}  # type: ignore[union-attr]
    stages["evaluate"] = trained["evaluate"]  # type: ignore[assignment]
    return {**trained, **report, "stages": stages}


@flow(name="train")
def train_flow(params: RunParams) -> dict[str, object]:
    return train_and_report(params)
