"""End to end through a real Prefect server: register the deployments of prefect.yaml, start a
process worker, trigger one with the ``prefect deployment run`` CLI, wait until it is Completed,
then check the store has the run. Everything runs on 127.0.0.1 with its database in a temp dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import REPO
from runner.launch import free_port

PREFECT = str(Path(sys.executable).parent / "prefect")
pytestmark = pytest.mark.slow


def stop(process: subprocess.Popen) -> None:
    """Stop a process group: SIGTERM, then SIGKILL if it has not exited within 30 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.fixture
def prefect_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_CLI_PROMPT="false", RETEXO_PROJECT_DIR=str(REPO),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", COLUMNS="200",
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=open(logs / "server.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    processes = [server]
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (logs / "server.log").read_text()
            time.sleep(0.5)
        env["RETEXO_TEST_LOGS"] = str(logs)
        yield env
    finally:
        for process in processes:
            stop(process)


def prefect(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"prefect {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


def test_prefect_deployment_run_trains_into_the_store(prefect_env: dict[str, str], tmp_path: Path) -> None:
    env = prefect_env
    prefect(env, "work-pool", "create", "retexo", "--type", "process")
    deployed = prefect(env, "--no-prompt", "deploy", "--all")
    assert "pipeline/cora-nightly" in deployed.stdout and "pipeline/cora-on-demand" in deployed.stdout
    schedules = prefect(env, "deployment", "inspect", "pipeline/cora-nightly").stdout
    assert "0 2 * * *" in schedules
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "retexo"], env=env, cwd=REPO,
                              stdout=open(Path(env["RETEXO_TEST_LOGS"]) / "worker.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    store = tmp_path / "store"
    try:
        overrides = {"params": {"preset": "configs/cora_gcn.yaml", "store": str(store),
                                "train": {"rounds": 3, "epochs": 3, "hidden": 16}}}
        run = prefect(env, "deployment", "run", "pipeline/cora-on-demand", "--params", json.dumps(overrides),
                      "--watch", "--watch-timeout", "600", timeout=660)
        assert "Completed" in run.stdout, run.stdout
    finally:
        stop(worker)
    manifests = {json.loads(path.read_text())["strategy"]: path for path in store.glob("runs/run=*/manifest.json")}
    assert sorted(manifests) == ["retexo", "standard"]  # the preset compares with the standard baseline
    manifest = json.loads(manifests["retexo"].read_text())
    assert manifest["status"] == "completed" and manifest["dataset_name"] == "cora"
    assert manifest["config"]["rounds"] == 3 and manifest["total_bytes"] > 0
    assert (manifests["retexo"].parent / "report" / "accuracy_vs_bytes.png").is_file()


def test_nightly_tables_deployment_retrains_only_when_the_export_changes(prefect_env: dict[str, str], tmp_path: Path) -> None:
    from conftest import write_table_version

    env = prefect_env
    prefect(env, "work-pool", "create", "retexo", "--type", "process")
    deployed = prefect(env, "--no-prompt", "deploy", "--all")
    assert "pipeline/tables-nightly" in deployed.stdout
    assert "0 3 * * *" in prefect(env, "deployment", "inspect", "pipeline/tables-nightly").stdout
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "retexo"], env=env, cwd=REPO,
                              stdout=open(Path(env["RETEXO_TEST_LOGS"]) / "nightly-worker.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    store, export = tmp_path / "store", tmp_path / "export"
    overrides = {"params": {"preset": "configs/nightly_tables.yaml", "store": str(store),
                            "dataset": {"name": "nightly", "source": "tables", "path": str(export)},
                            "partition": {"parts": 2},
                            "train": {"rounds": 20, "hidden": 16, "patience": None},
                            "promotion": {"tolerance": 1.0}}}

    def nightly_run() -> None:
        run = prefect(env, "deployment", "run", "pipeline/tables-nightly", "--params", json.dumps(overrides),
                      "--watch", "--watch-timeout", "600", timeout=660)
        assert "Completed" in run.stdout, run.stdout

    try:
        write_table_version(export, 1)
        nightly_run()
        write_table_version(export, 2)  # the export job rewrote the files overnight
        nightly_run()
    finally:
        stop(worker)
    datasets = [json.loads(p.read_text()) for p in store.glob("datasets/name=nightly/fp=*/manifest.json")]
    assert sorted(d["num_nodes"] for d in datasets) == [400, 420]
    runs = [json.loads(p.read_text()) for p in store.glob("runs/run=*/manifest.json")]
    trained = [r for r in runs if r["config"].get("rounds") == 20]  # each night: depth 2 and 3, one kept
    assert sorted((r["dataset"], r["config"]["layers"]) for r in trained) == sorted(
        (d["fp"], layers) for d in datasets for layers in (2, 3))
    decisions = [json.loads(p.read_text()) for p in sorted(store.glob("pipelines/name=nightly/decisions/*.json"))]
    assert [d["decision"] for d in decisions] == ["promoted", "promoted"]
    assert decisions[1]["incumbent"] == decisions[0]["run"] and decisions[1]["incumbent_evaluation_run"]
