"""Training as users run it: inductive hiding, residency of workers, failures, two nodes, reuse."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from conftest import REPO, cli_env, run_cli
from graphstore.ingest.api import ingest_tables
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.tables import TableOptions
from graphstore.layout import Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.runs import read_embeddings
from processes import communicate_all
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.launch import free_port
from runner.lifecycle import LaunchOptions, launch_layers, run_training
from runner.plan import layer_state, plan_run
from training_helpers import IN_PROCESS, run_and_kill_a_worker

N, F, C = 90, 6, 3


def write_graph(folder: Path, seed: int, test_noise: bool) -> dict[str, Path]:
    """A small labelled graph with an explicit split. With ``test_noise`` the test nodes get other
    features and extra edges to random nodes (both directions): nothing else changes."""
    rng = np.random.default_rng(0)
    label = rng.integers(0, C, N)
    split = np.array(["train"] * 45 + ["val"] * 20 + ["test"] * 25)
    x = rng.normal(size=(N, F)) + label[:, None]
    src, dst = rng.integers(0, N, 200), rng.integers(0, N, 200)
    if test_noise:
        noise = np.random.default_rng(seed)
        test = np.flatnonzero(split == "test")
        x[test] = noise.normal(size=(len(test), F)) * 5
        extra_src, extra_dst = noise.choice(test, 60), noise.integers(0, N, 60)
        src, dst = np.concatenate([src, extra_src]), np.concatenate([dst, extra_dst])
    folder.mkdir(parents=True)
    paths = {name: folder / f"{name}.parquet" for name in ("nodes", "edges", "features")}
    pd.DataFrame({"node_id": np.arange(N), "label": label, "split": split}).to_parquet(paths["nodes"])
    pd.DataFrame({"src": src, "dst": dst}).to_parquet(paths["edges"])
    pd.DataFrame({"node_id": np.arange(N), **{f"f{i}": x[:, i] for i in range(F)}}).to_parquet(paths["features"])
    return paths


def train_on(store: Store, name: str, paths: dict[str, Path], config: TrainConfig):
    dataset = ingest_tables(store, name, paths["edges"], paths["nodes"], paths["features"],
                            TableOptions(undirected=True, num_classes=C), SplitFractions())
    partition = build_partition(store, dataset, PartitionOptions(method="random", parts=3, seed=0))
    plan = plan_run(store, dataset, partition, config, NetworkModel())
    run_training(plan, IN_PROCESS)
    return plan


def weights(store: Store, plan, layer: int) -> dict[str, torch.Tensor]:
    return torch.load(store.layer_dir(plan.run_fp, layer) / "model.pt")


@pytest.mark.parametrize("strategy", ["retexo", "standard"])
def test_inductive_training_never_sees_test_nodes_or_their_edges(tmp_path: Path, strategy: str) -> None:
    """Changing only test nodes' features and edges leaves every trained weight the same (up to
    float rounding of differently sized matrix products) in the inductive setting, and changes
    them in the transductive one."""
    store = Store.open(tmp_path / "store")
    clean, noisy = write_graph(tmp_path / "a", 1, False), write_graph(tmp_path / "b", 1, True)
    config = TrainConfig(strategy=strategy, setting="inductive", recipe="default", hidden=8, rounds=4, epochs=4, lr=0.05,
                         dropout=0.0, timeout_s=60)  # dropout masks depend on the halo size
    plan_a, plan_b = train_on(store, "clean", clean, config), train_on(store, "noisy", noisy, config)
    for layer in (1, 2):
        wa, wb = weights(store, plan_a, layer), weights(store, plan_b, layer)
        for name in wa:
            torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=f"layer {layer} {name}")
    # the difference is real: predictions of test nodes on the full graph change
    node_id, logits_a = read_embeddings(store.embeddings_path(plan_a.run_fp, 2, 0))
    _, logits_b = read_embeddings(store.embeddings_path(plan_b.run_fp, 2, 0))
    assert not np.allclose(logits_a["full"], logits_b["full"])
    # ... while what model selection looked at (the val view of non-test nodes) does not
    not_test = pd.read_parquet(clean["nodes"]).set_index("node_id").loc[node_id, "split"].to_numpy() != "test"
    np.testing.assert_allclose(logits_a["val"][not_test], logits_b["val"][not_test], rtol=1e-5, atol=1e-5)
    transductive = config.model_copy(update={"setting": "transductive"})
    ta, tb = train_on(store, "clean", clean, transductive), train_on(store, "noisy", noisy, transductive)
    gap = max((a - b).abs().max().item() for a, b in zip(weights(store, ta, 1).values(), weights(store, tb, 1).values()))
    assert gap > 1e-3


@pytest.mark.slow
def test_workers_open_only_their_own_partition_and_embedding_rows(tmp_path: Path, tiny_plan_factory) -> None:
    plan = tiny_plan_factory(tmp_path, TrainConfig(recipe="default", hidden=8, rounds=2, timeout_s=60))
    audit = tmp_path / "audit"
    audit.mkdir()
    for layer in (1, 2):
        (audit / f"layer{layer}").mkdir()
        launch_layers(plan, [layer], LaunchOptions(audit_dir=str(audit / f"layer{layer}")))
    for layer in (1, 2):
        for rank in range(3):
            opened = (audit / f"layer{layer}" / f"rank-{rank}.txt").read_text().split()
            assert any(f"part={rank}/nodes.parquet" in p for p in opened)
            if layer == 2:
                assert any(f"layer=1/part={rank}/embeddings.parquet" in p for p in opened)
            for path in opened:
                assert "/datasets/" not in path and "assignment.parquet" not in path, path
                assert set(re.findall(r"part=(\d+)", path)) <= {str(rank)}, (rank, path)


@pytest.fixture
def tiny_plan_factory():
    def make(tmp_path: Path, config: TrainConfig):
        store = Store.open(tmp_path / "store")
        paths = write_graph(tmp_path / "graph", 0, False)
        dataset = ingest_tables(store, "g", paths["edges"], paths["nodes"], paths["features"],
                                TableOptions(undirected=True, num_classes=C), SplitFractions())
        partition = build_partition(store, dataset, PartitionOptions(method="random", parts=3, seed=0))
        return plan_run(store, dataset, partition, config, NetworkModel())
    return make


@pytest.mark.slow
def test_a_killed_worker_fails_the_run_quickly_naming_its_rank(tmp_path: Path) -> None:
    store = tmp_path / "store"
    run_cli("ingest", "planetoid", REPO / "data" / "cora", "--name", "cora", store=store).check_returncode()
    timeout = 60
    cmd = [sys.executable, "-m", "cli", "train", "cora", "--parts", "3", "--rounds", "100000",
           "--hidden", "16", "--timeout", str(timeout), "--store", str(store)]
    code, _, err, elapsed = run_and_kill_a_worker(cmd, cli_env(), store, workers=3, victim=1, timeout_s=timeout + 30)
    assert code == 2
    assert "worker rank 1 was killed by signal 9" in " ".join(err.split())
    assert elapsed < timeout
    assert not list((store / "runs").glob("run=*/layer=1/manifest.json"))


@pytest.mark.slow
def test_two_worker_launches_as_node_0_and_node_1_train_one_model_at_each_depth(tmp_path: Path) -> None:
    """Two ``retexo worker`` launches, one per node, train the run and the run one layer deeper
    (the depth choice), each over both nodes' ranks."""
    store = tmp_path / "store"
    run_cli("ingest", "planetoid", REPO / "data" / "cora", "--name", "cora", store=store).check_returncode()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "dataset": {"name": "cora"},
        "partition": {"method": "metis", "parts": 2},
        # the default recipe: the search (tested on its own) took this test past 5 minutes on a
        # busy machine
        "train": {"strategy": "retexo", "recipe": "default", "choose_depth": True, "hidden": 16, "rounds": 20,
                  "lr": 0.05, "timeout_s": 60},
    }))
    port = free_port()
    nodes = [
        subprocess.Popen([sys.executable, "-m", "cli", "worker", str(config), "--nnodes", "2",
                          "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                          "--store", str(store)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                         stdin=subprocess.DEVNULL)
        for rank in (0, 1)
    ]
    outputs = communicate_all(nodes, timeout=600)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "node 1: ranks [1] finished" in outputs[1][1]
    manifests = {len(json.loads(p.read_text())["layers"]): p for p in (store / "runs").glob("run=*/manifest.json")}
    assert sorted(manifests) == [2, 3]
    for manifest in manifests.values():
        comm = pd.read_parquet(manifest.parent / "comm.parquet")
        assert set(comm["src"]) == {0, 1}  # both nodes' ranks sent their share
        assert json.loads(manifest.read_text())["test_acc"] > 0.5
    assert "depth chosen on validation" in outputs[0][0] + outputs[0][1]


def test_finished_layers_are_reused_and_only_changed_layers_retrain(tmp_path: Path, tiny_plan_factory) -> None:
    config = TrainConfig(recipe="default", hidden=8, rounds=[3, 2], timeout_s=60)
    plan = tiny_plan_factory(tmp_path, config)
    _, first = run_training(plan, IN_PROCESS)
    assert [p.state for p in first] == ["trained", "trained"]
    _, again = run_training(plan_run(plan.store, *_refs(plan), config, NetworkModel()), IN_PROCESS)
    assert [p.state for p in again] == ["cached", "cached"]
    changed = plan_run(plan.store, *_refs(plan), config.model_copy(update={"rounds": [3, 4]}), NetworkModel())
    assert changed.run_fp != plan.run_fp
    _, third = run_training(changed, IN_PROCESS)
    assert [p.state for p in third] == ["reused", "trained"]
    assert torch.equal(*(torch.load(plan.store.layer_dir(p.run_fp, 1) / "model.pt")["block.conv.lin.weight"]
                         for p in (plan, changed)))


def test_a_run_killed_after_its_first_layer_resumes_at_the_second(tmp_path: Path, tiny_plan_factory) -> None:
    plan = tiny_plan_factory(tmp_path, TrainConfig(recipe="default", hidden=8, rounds=2, timeout_s=60))
    launch_layers(plan, [1], IN_PROCESS)  # as if the process died while layer 2 was training
    assert [layer_state(plan, l) for l in (1, 2)] == ["done", "pending"]
    _, progress = run_training(plan, IN_PROCESS)
    assert [p.state for p in progress] == ["cached", "trained"]


def _refs(plan):
    from graphstore.lookup import PartitionRef, find_dataset

    return find_dataset(plan.store, plan.dataset_fp), PartitionRef.at(Path(plan.source_dir))


def test_rank_0_reports_its_rounds_with_val_accuracy_and_the_bytes_of_all_ranks(tmp_path: Path,
                                                                                 tiny_plan_factory) -> None:
    """The launcher hears each layer's rounds from the ranks' progress files: rank 0's round and
    val accuracy, bytes summed over ranks, the last round of every layer included (the last layer's
    rounds followed by those of the last two layers together)."""
    from runner.results import progress_path

    plan = tiny_plan_factory(tmp_path, TrainConfig(recipe="default", hidden=8, rounds=[3, 2], joint_rounds=4,
                                                   timeout_s=60))
    seen = []
    run_training(plan, IN_PROCESS, on_round=seen.append)
    assert {(p.layer, p.total) for p in seen} == {(1, 3), (2, 6)}
    # a last round may be heard twice: again when a peer's final byte count lands after rank 0's file
    assert sorted({(p.layer, p.done) for p in seen if p.done == p.total}) == [(1, 3), (2, 6)]
    assert all(p.val_acc is not None and 0 <= p.val_acc <= 1 for p in seen)
    assert [p.bytes_sent for p in seen] == sorted(p.bytes_sent for p in seen) and seen[-1].bytes_sent > 0
    assert all(progress_path(plan.store_root, plan.run_fp, layer, rank).is_file() for layer in (1, 2)
               for rank in range(plan.world))
