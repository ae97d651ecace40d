"""``kill -9`` of a training command leaves its run ``interrupted`` and no temp folder, whenever it
comes.

The command's guard (``runner/descendant_guard.py``) records ``interrupted`` and removes the run's
temp folders once the command and its workers (which hold the run too) are gone. Each test below
SIGKILLs a real ``retexo train`` or ``retexo run`` at one point of the run, found by watching the
store, and checks within ``GONE_S``: every process of its tree is gone, the run's last event is
``interrupted`` naming the launcher, and the run's folder holds no ``.tmp-*`` entry. Two tests
kill a small launcher script instead, for the moments without workers (finalisation) and for a
worker that outlives its launcher for a while.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from conftest import CORA_DIR, RETEXO, REPO, cli_env, run_cli, table_rows
from graphstore.history import last_event
from graphstore.ingest.api import ingest_planetoid
from graphstore.layout import MANIFEST, TMP_PREFIX, Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from processes import command_line
from training_helpers import training_started, worker_processes

pytestmark = pytest.mark.slow

WORKERS = 2
GONE_S = 15.0  # bound on the clean-up after the kill
START_S = 300.0  # bound on reaching the point of the kill


@pytest.fixture(scope="module")
def cora_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kill-template")
    store = Store.open(root)
    build_partition(store, ingest_planetoid(store, CORA_DIR, "cora"), PartitionOptions(method="random", parts=WORKERS))
    return root


@pytest.fixture
def store(cora_template: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(cora_template, root)
    return root


def train_command(store: Path, rounds: int) -> list[str]:
    return [*RETEXO, "train", "cora", "--parts", str(WORKERS), "--partition-method", "random", "--hidden", "16",
            "--rounds", str(rounds), "--no-choose-depth", "--store", str(store)]


def run_dirs(store: Path) -> list[Path]:
    return sorted((store / "runs").glob("run=*"))


def any_event(store: Path) -> bool:
    return any(run.glob("events/*-started.json") for run in run_dirs(store))


def layer_one_committed(store: Path) -> bool:
    return any((run / "layer=1" / MANIFEST).exists() for run in run_dirs(store))


def kill_when(command: list[str], ready: Callable[[psutil.Process], bool], env: dict[str, str] | None = None
              ) -> tuple[int, list[str]]:
    """Start ``command``, SIGKILL it as soon as ``ready(its process)``; once its whole process tree
    is gone (killed after ``GONE_S`` if not, failing the test), returns its pid and the command
    lines of that tree at the kill."""
    proc = subprocess.Popen(command, cwd=REPO, env=env or cli_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + START_S
        while not ready(parent):
            assert proc.poll() is None, f"the command ended before the kill: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "the point of the kill never came"
            time.sleep(0.01)
        family = parent.children(recursive=True)
        commands = []
        for process in family:
            try:
                commands.append(" ".join(process.cmdline()))
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + GONE_S
    while (left := running(family)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in left:  # not left to the next test
        process.kill()
    assert not left, f"still running {GONE_S:g} s after the kill: {[p.pid for p in left]}"
    return proc.pid, commands


def running(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_interrupted_and_clean(store: Path, launcher: int) -> Path:
    """The one run of ``store`` ends ``interrupted`` (by the launcher's guard) with no temp entry."""
    runs = run_dirs(store)
    assert len(runs) == 1, runs
    run = runs[0].name.removeprefix("run=")
    deadline = time.monotonic() + GONE_S  # the guard is gone by now: this is its record
    while (last := last_event(Store(store), run)) is None or last["event"] != "interrupted":
        assert time.monotonic() < deadline, f"last event of run {run}: {last}"
        time.sleep(0.1)
    assert last["detail"] == f"the launcher (pid {launcher}) died; workers stopped"
    left = [str(p.relative_to(runs[0])) for p in runs[0].rglob(f"{TMP_PREFIX}*")]
    assert not left, f"temp entries left in the run's folder: {left}"
    return runs[0]


@pytest.mark.parametrize("point", ["started", "training", "layer-1-committed"])
def test_sigkill_of_retexo_train_leaves_the_run_interrupted_and_no_temp_folder(store: Path, point: str) -> None:
    """Killed just after the run's ``started`` event (workers not spawned or starting), while every
    rank trains, or just after layer 1 was committed (layer 2 starting); after the last, the same
    command resumes at layer 2."""
    ready = {
        "started": lambda parent: any_event(store),
        "training": lambda parent: len(worker_processes(parent)) == WORKERS and training_started(store, WORKERS),
        "layer-1-committed": lambda parent: layer_one_committed(store),
    }[point]
    rounds = 300 if point == "layer-1-committed" else 100000
    launcher, _ = kill_when(train_command(store, rounds), ready)
    run_dir = assert_interrupted_and_clean(store, launcher)
    if point == "layer-1-committed":
        assert (run_dir / "layer=1" / MANIFEST).exists()
        again = run_cli(*train_command(store, rounds)[len(RETEXO):], timeout=300)
        assert again.returncode == 0, again.stderr
        assert [row[:2] for row in table_rows(again.stdout)[:2]] == [["1", "cached"], ["2", "trained"]], again.stdout
        assert last_event(Store(store), run_dir.name.removeprefix("run="))["event"] == "completed"  # type: ignore[index]


def test_sigkill_of_retexo_run_leaves_the_run_interrupted_and_no_temp_folder(store: Path, tmp_path: Path) -> None:
    """The Prefect pipeline in the command's process: its guard also stops Prefect's temporary server."""
    env = {**cli_env(), "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"dataset: {{name: cora, source: planetoid, path: {CORA_DIR}}}\n"
                      f"partition: {{method: random, parts: {WORKERS}}}\n"
                      "train: {hidden: 16, rounds: 100000, timeout_s: 60}\n")
    launcher, family = kill_when(
        [*RETEXO, "run", str(preset), "--store", str(store)],
        lambda parent: len(worker_processes(parent)) == WORKERS and training_started(store, WORKERS), env)
    assert any("uvicorn" in command for command in family), family  # Prefect's temporary server: gone too
    assert_interrupted_and_clean(store, launcher)


LAUNCHER = """
import sys, time
from pathlib import Path
from graphstore.history import hold_run, record_run_event
from graphstore.layout import Store
from runner.descendant_guard import guard_run

store, run, temp = Store.open(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with guard_run(store, run), hold_run(store, run):
    record_run_event(store, run, "started", "test")
    temp.mkdir(parents=True)
    (temp / "part.bin").write_bytes(b"x" * 1000)
    print("ready", flush=True)
    time.sleep(600)
"""

WORKER = """
import sys, time
from pathlib import Path
from graphstore.history import hold_run
from graphstore.layout import Store

store, run, temp = Store.open(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with hold_run(store, run):
    print("holding", flush=True)
    sys.stdin.read()  # until the launcher is gone
    time.sleep(1.5)  # a worker that takes its time to go
    (temp / "late.bin").write_bytes(b"y")
    print(time.time(), flush=True)
"""


def start_launcher(store: Path, run: str, temp: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(store), run, str(temp)], cwd=REPO, env=cli_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_launcher_killed_without_workers_is_finished_by_its_guard(tmp_path: Path) -> None:
    """The moments without worker processes (before the spawn, finalisation): the guard alone."""
    store, run = tmp_path / "store", "f" * 16
    temp = Store.open(store).run_dir(run) / f"{TMP_PREFIX}comm.parquet-1-abc"
    proc = start_launcher(store, run, temp)
    guard = [p for p in psutil.Process(proc.pid).children() if "runner.descendant_guard" in command_line(p)]
    assert len(guard) == 1
    proc.kill()
    proc.wait(timeout=30)
    guard[0].wait(timeout=GONE_S)
    assert last_event(Store(store), run)["detail"] == f"the launcher (pid {proc.pid}) died; workers stopped"  # type: ignore[index]
    assert not temp.exists()


def test_the_guard_waits_for_a_worker_that_still_holds_the_run(tmp_path: Path) -> None:
    """A worker holds the run as long as it lives: the guard records and cleans up only after it
    exited, so nothing the worker wrote late is left behind."""
    store, run = tmp_path / "store", "e" * 16
    temp = Store.open(store).run_dir(run) / f"{TMP_PREFIX}layer=1-1234"
    proc = start_launcher(store, run, temp)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(store), run, str(temp)], cwd=REPO, env=cli_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "holding"
        proc.kill()
        proc.wait(timeout=30)
        worker.stdin.close()  # type: ignore[union-attr]
        ended = float(worker.stdout.readline())
        assert worker.wait(timeout=GONE_S) == 0
    finally:
        worker.kill()
    deadline = time.monotonic() + GONE_S
    while (last := last_event(Store(store), run)) is None or last["event"] != "interrupted":
        assert time.monotonic() < deadline, last
        time.sleep(0.05)
    assert datetime.fromisoformat(last["happened_at"]).timestamp() >= ended
    assert not temp.exists()
