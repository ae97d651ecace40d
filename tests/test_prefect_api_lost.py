"""A Prefect API lost while ``retexo run`` trains fails none of the committed work.

A real Prefect API (``prefect server start``, as in test_deployment.py, or the temporary server
``retexo run`` starts itself) is killed with SIGKILL once every rank trains. Training and
finalisation go on from the store (artifacts are best-effort, ``tasks.best_effort``); the
command then says in one line that the API was lost and where the completed run is, and exits
with code 2 (the flow run's state could not be recorded) soon after the report is written,
without a traceback or Prefect's per-item warnings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import CORA_DIR, RETEXO, REPO, cli_env
from graphstore.history import last_event
from graphstore.ingest.api import ingest_planetoid
from graphstore.layout import TMP_PREFIX, Store
from graphstore.manifests import RunManifest, read_manifest
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from processes import command_line
from runner.launch import free_port
from training_helpers import training_started

PREFECT = str(Path(sys.executable).parent / "prefect")
pytestmark = pytest.mark.slow

WORKERS = 2
PROMPT_S = 60.0  # the exit after the report is written (before: 315 s of retries after a loss)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    st = Store.open(root)
    build_partition(st, ingest_planetoid(st, CORA_DIR, "cora"), PartitionOptions(method="random", parts=WORKERS))
    return root


@pytest.fixture
def prefect_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in cli_env().items() if not k.startswith("PREFECT_") or "STARTUP_TIMEOUT" in k}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return env


@pytest.fixture
def prefect_server(prefect_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``prefect server start`` on a free port of 127.0.0.1 (its own session); ``prefect_env``
    points at it."""
    port = free_port()
    prefect_env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=prefect_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        yield server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        log.close()


def run_and_lose_the_api(store: Path, env: dict[str, str], preset: Path, kill_api: Callable[[psutil.Process], None]
                         ) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the pipeline, call ``kill_api(its process)`` once every rank trains; returns the
    finished command and the time it exited (``time.time()``)."""
    proc = subprocess.Popen([*RETEXO, "run", str(preset), "--store", str(store)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not training_started(store, WORKERS):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.1)
        kill_api(psutil.Process(proc.pid))
        out, err = proc.communicate(timeout=600)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.time()
    finally:
        if proc.poll() is None:
            proc.kill()


def kill_the_temporary_server(command: psutil.Process) -> None:
    servers = [p for p in command.children(recursive=True) if "uvicorn" in command_line(p)]
    assert servers, "no temporary Prefect server under retexo run"
    for server in servers:
        server.kill()


@pytest.mark.parametrize("api", ["prefect server start", "temporary server"])
def test_a_lost_prefect_api_fails_no_committed_work_and_the_command_says_so_at_once(
        store: Path, prefect_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest, api: str) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"dataset: {{name: cora, source: planetoid, path: {CORA_DIR}}}\n"
                      f"partition: {{method: random, parts: {WORKERS}}}\n"
                      "train: {hidden: 16, rounds: 300, timeout_s: 60, choose_depth: false}\n")
    if api == "prefect server start":
        server = request.getfixturevalue("prefect_server")
        result, exited = run_and_lose_the_api(store, prefect_env, preset,
                                              lambda command: os.killpg(server.pid, signal.SIGKILL))
        where = prefect_env["PREFECT_API_URL"]
    else:
        result, exited = run_and_lose_the_api(store, prefect_env, preset, kill_the_temporary_server)
        where = "the temporary server"
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "warning" in line.lower()]
    runs = sorted((store / "runs").glob("run=*"))
    assert len(runs) == 1, runs
    run = runs[0].name.removeprefix("run=")
    assert len(errors) == 1 and errors[0].startswith(f"error: the Prefect API at {where} was lost"), result.stderr
    assert f"the pipeline completed: run {run} is in {runs[0]}" in errors[0], errors[0]
    assert "Traceback" not in result.stderr and "prefect" not in result.stderr.replace(errors[0], ""), result.stderr
    manifest = read_manifest(runs[0], RunManifest)  # the run was finalised from the store
    assert [layer.layer for layer in manifest.layers] == [1, 2] and manifest.test_acc is not None
    assert last_event(Store(store), run)["event"] == "completed"  # type: ignore[index]
    assert not list(runs[0].rglob(f"{TMP_PREFIX}*"))
    report = runs[0] / "report" / "report.md"
    assert report.is_file()
    assert exited - report.stat().st_mtime < PROMPT_S, f"exited {exited - report.stat().st_mtime:.0f} s after the report"
