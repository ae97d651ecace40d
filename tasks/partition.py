"""Partition a stored dataset; ``cached`` when the partition with this fingerprint is in the store."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from graphstore.catalog import refresh_catalog
from graphstore.layout import Store
from graphstore.lookup import find_dataset, find_partition
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions


@task(name="partition", cache_policy=NO_CACHE)
def partition_task(store_root: str, dataset_fp: str, options: PartitionOptions,
                   force: bool = False) -> dict[str, object]:
    """``force``: partition even when the memory estimate exceeds the memory available now."""
    store = Store.open(store_root)
    dataset = find_dataset(store, dataset_fp)
    ref = find_partition(store, dataset, options)
    stage = "cached" if ref is not None else "done"
    if ref is None:
        ref = build_partition(store, dataset, options, force=force)
        refresh_catalog(store)
    get_run_logger().info("partition %s: %s into %d parts, edge cut %d, halo %d (%s)", ref.fp, ref.method,
                          ref.parts, ref.edge_cut, ref.halo_total, stage)
    return {"fp": ref.fp, "method": ref.method, "parts": ref.parts, "edge_cut": ref.edge_cut,
            "halo_total": ref.halo_total, "stage": stage}
