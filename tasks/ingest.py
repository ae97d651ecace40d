"""Ingest a dataset (or find it in the store) and return a small reference."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from graphstore.ingest.spec import DatasetSpec, ingest_source
from graphstore.layout import Store


@task(name="ingest", cache_policy=NO_CACHE)
def ingest_task(store_root: str, spec: DatasetSpec) -> dict[str, object]:
    """Unchanged sources are a no-op in the store and are reported as cached."""
    ref = ingest_source(Store.open(store_root), spec)
    status = "written" if ref.created else "cached"
    get_run_logger().info("dataset %s (%s): %s, %d nodes, %d edges", ref.name, ref.fp, status, ref.num_nodes, ref.num_edges)
    return {"name": ref.name, "fp": ref.fp, "nodes": ref.num_nodes, "edges": ref.num_edges, "status": status}
