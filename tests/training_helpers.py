"""Helpers shared by the training and strategy tests: a tiny graph, small configs, byte formulas."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch

from graphstore.ingest.api import ingest_synthetic
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.synthetic import SyntheticOptions
from graphstore.layout import Store
from graphstore.lookup import DatasetRef, PartitionRef
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from processes import command_line
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.lifecycle import LaunchOptions, run_training
from runner.plan import RunPlan, plan_run

IN_PROCESS = LaunchOptions(launcher="threads")  # ranks as threads: same bytes and results, no spawn

K = 3
F, C, HIDDEN = 5, 3, 8


def make_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, DatasetRef, PartitionRef]:
    """A 60-node synthetic graph in K random partitions (the ``tiny`` fixture of conftest)."""
    store = Store.open(tmp_path_factory.mktemp("train-store"))
    dataset = ingest_synthetic(
        store, "tiny", SyntheticOptions(nodes=60, avg_degree=4, classes=C, features=F, seed=1),
        SplitFractions(train=0.5, val=0.25, seed=1),
    )
    partition = build_partition(store, dataset, PartitionOptions(method="random", parts=K, seed=0))
    return store, dataset, partition


def ingest_sbm(store: Store) -> DatasetRef:
    """A 300-node SBM with dense features (3 classes): enough validation nodes and edges that the
    local graphs' figures differ from the full graph's."""
    return ingest_synthetic(store, "sbm", SyntheticOptions(nodes=300, avg_degree=8, classes=3, features=F, seed=2),
                            SplitFractions(seed=2))


def small_config(**overrides: object) -> TrainConfig:
    base = dict(hidden=HIDDEN, rounds=3, epochs=3, lr=0.05, dropout=0.0, timeout_s=60, eval_every=1, recipe="default",
                joint_rounds=0, joint_fresh=False)
    return TrainConfig(**{**base, **overrides})


def train(store: Store, dataset: DatasetRef, partition: PartitionRef | None, config: TrainConfig) -> RunPlan:
    """Train (ranks as threads of this process) and return the run's plan."""
    plan = plan_run(store, dataset, partition, config, NetworkModel())
    run_training(plan, IN_PROCESS)
    return plan


def comm_log(plan: RunPlan) -> dict[str, int]:
    table = pq.read_table(plan.store.run_dir(plan.run_fp) / "comm.parquet").to_pandas()
    return table.groupby("kind")["bytes"].sum().to_dict()


def halo_total(partition: PartitionRef) -> int:
    return sum(pq.read_metadata(partition.path / f"part={i}" / "halo.parquet").num_rows for i in range(K))


def ring(nbytes: int) -> int:
    """Bytes all workers together send for a ring all-reduce of ``nbytes``."""
    return 2 * (K - 1) * nbytes


def params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def worker_processes(parent: psutil.Process) -> list[psutil.Process]:
    """The spawned training workers of a ``retexo`` process, in rank (start) order."""
    children = [c for c in parent.children(recursive=True) if "spawn_main" in command_line(c)]
    return sorted(children, key=lambda c: c.create_time())


def training_started(store: Path, workers: int) -> bool:
    """Every rank has joined the process group and loaded its partition (its log says so)."""
    logs = [p.read_text() for p in store.glob("runs/run=*/logs/rank-*.log")]
    return sum("owned nodes" in text for text in logs) >= workers


def run_and_kill_a_worker(cmd: list[str], env: dict[str, str], store: Path, workers: int, victim: int,
                          settle_s: float = 3, timeout_s: float = 300) -> tuple[int, str, str, float]:
    """Run ``cmd``, SIGKILL its worker ``victim`` once training is under way; returns
    (exit code, stdout, stderr, seconds from the kill to the exit)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 300
        while len(found := worker_processes(parent)) < workers or not training_started(store, workers):
            assert time.monotonic() < deadline and proc.poll() is None, "workers never started"
            time.sleep(0.2)
        time.sleep(settle_s)
        found[victim].kill()
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err, time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()

