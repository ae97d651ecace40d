"""Shared by the benchmark scripts: datasets, one measured run, tables in markdown."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graphstore.ingest.api import ingest_planetoid, ingest_synthetic  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.synthetic import SyntheticOptions  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef  # noqa: E402
from retexo_core.comm.log import KINDS  # noqa: E402
from retexo_core.comm.network import NetworkModel, bytes_by_kind, simulated_seconds  # noqa: E402
from retexo_core.config import TrainConfig  # noqa: E402
from runner.lifecycle import run_training  # noqa: E402
from runner.request import RunRequest, prepare_run  # noqa: E402


def cora(store: Store) -> DatasetRef:
    return ingest_planetoid(store, REPO / "data" / "cora", "cora")


def dense_sbm(store: Store, nodes: int, degree: float) -> DatasetRef:
    """A Reddit-like dense graph: SBM with average degree ``degree``, 32 features, otherwise the
    generator's defaults (10 classes, homophily 0.3, class overlap and feature noise: not easy)."""
    return ingest_synthetic(
        store, "sbm-dense",
        SyntheticOptions(nodes=nodes, avg_degree=degree, features=32, seed=0),
        SplitFractions(train=0.1, val=0.1, seed=0),
    )


def measure(store: Store, dataset: DatasetRef, partition: Any, label: str, networks: dict[str, NetworkModel],
            **options: Any) -> dict[str, Any]:
    """Train one configuration (or reuse it from the store) and return its figures."""
    config = TrainConfig(**{"hidden": 256, "layers": 2, "timeout_s": 1800, **options})
    started = time.perf_counter()
    plan = prepare_run(RunRequest.over(store, dataset, partition, config, next(iter(networks.values()))),
                       partitions="stored")
    summary, progress = run_training(plan)
    comm = pq.read_table(store.run_dir(plan.run_fp) / "comm.parquet")
    row = {"run": plan.run_fp, "strategy": label, "model": config.model, "test_acc": summary.accuracy("test"),
           "bytes": bytes_by_kind(comm), "total": summary.total_bytes,
           "sim": {name: simulated_seconds(comm, net)[0] for name, net in networks.items()},
           "wall_s": time.perf_counter() - started, "cached": all(p.state == "cached" for p in progress)}
    print(f"  {label} {config.model}: test {row['test_acc']:.3f}, {mb(row['total'])} MB"
          f"{' (from the store)' if row['cached'] else ''}", flush=True)
    return row


def mb(value: float) -> str:
    return f"{value / 1e6:,.1f}"


def print_rows(title: str, rows: list[dict[str, Any]], networks: list[str]) -> None:
    print(f"\n{title}\n")
    header = ["model", "strategy", "test acc", "total MB"] + [f"{k} MB" for k in KINDS] + [f"sim s {n}" for n in networks]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = [r["model"], r["strategy"], f"{r['test_acc']:.3f}", mb(r["total"])]
        cells += [mb(r["bytes"].get(k, 0)) for k in KINDS]
        cells += [f"{r['sim'][n]:.1f}" for n in networks]
        print("| " + " | ".join(cells) + " |")
