"""``partition_flow``: partition a stored dataset (``cached`` when the store has it)."""

from __future__ import annotations

from prefect import flow

from flows.params import PartitionParams
from graphstore.layout import Store
from graphstore.lookup import find_dataset
from tasks.partition import partition_task


@flow(name="partition")
def partition_flow(params: PartitionParams) -> dict[str, object]:
    store = Store.open(params.store)
    return partition_task(str(store.root), find_dataset(store, params.dataset).fp, params.partition)
