"""``retexo worker`` under torchrun: two torchrun "nodes" on this machine (c10d rendezvous,
``--nnodes 2 --nproc-per-node 1``) train the same result as ``retexo train``, and a worker killed
mid-layer is restarted by torch elastic (``--max-restarts 1``), the run resuming at that layer."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch

from conftest import CORA_DIR, REPO, cli_env, run_cli
from graphstore.ingest.api import ingest_planetoid
from graphstore.layout import Store
from processes import communicate_all, cpu_share
from runner.launch import free_port
from training_helpers import worker_processes

pytestmark = pytest.mark.slow
TORCHRUN = REPO / ".venv" / "bin" / "torchrun"
RETEXO_BIN = REPO / ".venv" / "bin" / "retexo"


@pytest.fixture(scope="module")
def cora_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchrun-template")
    ingest_planetoid(Store.open(root), CORA_DIR, "cora")
    return root


def fresh_store(template: Path, at: Path) -> Path:
    shutil.copytree(template, at)
    return at


def preset(tmp_path: Path, rounds: str, extra: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(f"dataset: {{name: cora, source: planetoid, path: {CORA_DIR}}}\n"
                    "partition: {method: random, parts: 2}\n"
                    f"train: {{hidden: 16, rounds: {rounds}, timeout_s: 60, choose_depth: false{extra}}}\n")
    return path


def start_nodes(job: Path, store: Path, max_restarts: int) -> list[subprocess.Popen[str]]:
    """Two torchrun agents, one per "node" on its own share of the CPUs (``cpu_share``), meeting at
    a c10d rendezvous on 127.0.0.1; the ranks' process group forms on another port."""
    if not TORCHRUN.is_file():
        pytest.skip(f"{TORCHRUN} is missing")
    endpoint, group_port = f"127.0.0.1:{free_port()}", free_port()
    command = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", endpoint, "--rdzv-id", "retexo-test", "--max-restarts", str(max_restarts),
               "--no-python", str(RETEXO_BIN), "worker", str(job), "--master-port", str(group_port),
               "--store", str(store)]
    return [subprocess.Popen(command, cwd=REPO, env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=cpu_share(k, 2)) for k in range(2)]


def finish(nodes: list[subprocess.Popen[str]], timeout: float = 300) -> None:
    outputs = communicate_all(nodes, timeout)
    assert [node.returncode for node in nodes] == [0, 0], outputs


def the_run(store: Path) -> Path:
    runs = list(store.glob("runs/run=*"))
    assert len(runs) == 1, runs
    return runs[0]


def test_two_torchrun_nodes_train_what_retexo_train_trains(cora_store: Path, tmp_path: Path) -> None:
    job = preset(tmp_path, "30")
    store = fresh_store(cora_store, tmp_path / "torchrun")
    finish(start_nodes(job, store, max_restarts=0))
    reference = fresh_store(cora_store, tmp_path / "train")
    trained = run_cli("train", "cora", "--parts", 2, "--partition-method", "random", "--hidden", 16,
                      "--rounds", 30, "--timeout", 60, "--no-choose-depth", store=reference, timeout=300)
    assert trained.returncode == 0, trained.stderr
    run, expected = the_run(store), the_run(reference)
    assert run.name == expected.name  # the same configuration, partition and fingerprints
    for layer in (1, 2):
        ours, theirs = (torch.load(r / f"layer={layer}" / "model.pt") for r in (run, expected))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert pq.read_table(run / "comm.parquet").equals(pq.read_table(expected / "comm.parquet"))
    assert json.loads((run / "manifest.json").read_text())["test_acc"] == \
        json.loads((expected / "manifest.json").read_text())["test_acc"]


def test_a_worker_killed_mid_layer_is_restarted_by_torch_elastic_and_resumes_at_that_layer(
        cora_store: Path, tmp_path: Path) -> None:
    store = fresh_store(cora_store, tmp_path / "store")
    # The fresh pair (on by default on Cora) would add its rounds after layer 2; this test is about
    # the restart, so it trains the layers alone and stays well inside the timeouts (layer 2's
    # recipe screens and 600 rounds: long enough to be killed in a second after layer 1 commits).
    nodes = start_nodes(preset(tmp_path, "[30, 600]", ", joint_fresh: false"), store, max_restarts=1)
    try:
        deadline = time.monotonic() + 300
        while not list(store.glob("runs/run=*/layer=1/manifest.json")):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "layer 1 never finished"
            time.sleep(0.2)
        layer1 = next(store.glob("runs/run=*/layer=1/manifest.json"))
        committed = (layer1.stat().st_mtime_ns, layer1.read_text())
        time.sleep(1.0)  # into layer 2
        workers = [w for node in nodes for w in worker_processes(psutil.Process(node.pid))]
        assert len(workers) == 2, workers
        workers[-1].kill()
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    finish(nodes)
    run = the_run(store)
    assert (layer1.stat().st_mtime_ns, layer1.read_text()) == committed  # layer 1 was not trained again
    events = [p.name.rsplit("-", 1)[1].removesuffix(".json") for p in sorted((run / "events").glob("*.json"))]
    assert events[0] == "started" and events[-2:] == ["started", "completed"], events
    assert events[1] in ("interrupted", "failed") and len(events) == 4, events
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["test_acc"] > 0.5
