"""Faults around the workers of a training run, with real processes and signals.

The launcher (``retexo train``) killed with SIGKILL or SIGTERM leaves no worker behind and the run
marked ``interrupted``; a worker stopped (SIGSTOP) is named by its rank within the hang timeout;
two identical trains on one store train each layer once; too many worker processes are refused
before anything starts; a run left ``started`` by a launcher that is gone is marked by
``store gc`` and by the next run.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import time
from contextlib import closing
from pathlib import Path

import psutil
import pytest

from conftest import CORA_DIR, RETEXO, REPO, cli_env, flat, run_cli, table_rows
from graphstore.history import ABANDONED, hold_run, last_event, record_run_event
from graphstore.ingest.api import ingest_planetoid
from graphstore.layout import MANIFEST, TMP_PREFIX, Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from processes import communicate_all
from retexo_core.comm.network import NetworkModel
from runner.plan import plan_run
from training_helpers import IN_PROCESS, small_config, training_started, worker_processes

WORKERS = 2
# a bound on failure only: `retexo run` starts a temporary Prefect server first, which took over 120 s
# once while `make test`'s four workers shared two cores
START_S = 300
GONE_S = 10.0  # bound on the clean-up after a launcher dies
BOTH_TRAINED_S = 600  # bound on two identical trains, the second waiting on the first's locks


@pytest.fixture(scope="module")
def cora_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with Cora and its random partition into 2 (what the train commands below use)."""
    root = tmp_path_factory.mktemp("faults-template")
    store = Store.open(root)
    build_partition(store, ingest_planetoid(store, CORA_DIR, "cora"), PartitionOptions(method="random", parts=2))
    return root


@pytest.fixture
def store(cora_template: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(cora_template, root)
    return root


def train_command(store: Path, *extra: object) -> list[str]:
    return [*RETEXO, "train", "cora", "--parts", str(WORKERS), "--partition-method", "random", "--hidden", "16",
            *map(str, extra), "--store", str(store)]


def start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, cwd=REPO, env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_training(proc: subprocess.Popen[str], store: Path, started: bool = True) -> list[psutil.Process]:
    """Once every worker runs and (``started``) has joined and loaded its partition: the
    launcher's whole process tree."""
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + START_S
    while len(worker_processes(parent)) < WORKERS or (started and not training_started(store, WORKERS)):
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()  # a run of 100,000 rounds would keep communicate() waiting for hours
            raise AssertionError(f"training never started: {proc.communicate(timeout=30)}")
        time.sleep(0.1)
    return parent.children(recursive=True)


def lingering(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (zombies waiting for a reaper count as gone)."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def assert_all_gone(processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + GONE_S
    while lingering(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = lingering(processes)
    for process in left:  # do not leave them to the next test
        process.kill()
    assert not left, f"still running {GONE_S:g} s after the launcher died: {[p.cmdline() for p in left]}"


def sigkill_once_training(proc: subprocess.Popen[str], store: Path, started: bool = True) -> list[str]:
    """SIGKILL ``proc`` once its workers run (``started``: and train); assert that its whole process
    tree is gone within ``GONE_S``; returns the command lines of that tree (taken before the kill)."""
    try:
        family = wait_for_training(proc, store, started)
        commands = [" ".join(p.cmdline()) for p in family]
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert_all_gone(family)
    finally:
        if proc.poll() is None:
            proc.kill()
    return commands


def the_run(store: Path) -> str:
    runs = [p.name.removeprefix("run=") for p in (store / "runs").glob("run=*")]
    assert len(runs) == 1, runs
    return runs[0]


def wait_for_last_event(store: Path, run: str, event: str) -> dict[str, object]:
    deadline = time.monotonic() + GONE_S
    while (last := last_event(Store(store), run)) is None or last["event"] != event:
        assert time.monotonic() < deadline, f"last event of run {run}: {last}"
        time.sleep(0.1)
    return last


def assert_nothing_committed(store: Path, run: str) -> None:
    run_dir = store / "runs" / f"run={run}"
    assert not list(run_dir.glob(f"layer=*/{MANIFEST}"))
    assert not list(run_dir.glob(f"{TMP_PREFIX}layer=*")), "a temp layer folder was left behind"


@pytest.mark.slow
@pytest.mark.parametrize("started", [False, True], ids=["start-up", "training"])
def test_sigkill_of_the_launcher_stops_its_workers_and_marks_the_run_interrupted(store: Path, started: bool) -> None:
    """Killed as soon as its workers are spawned (before the process group forms), or while they train."""
    proc = start(train_command(store, "--rounds", 100000))
    sigkill_once_training(proc, store, started)
    run = the_run(store)
    last = wait_for_last_event(store, run, "interrupted")
    assert last["detail"] == f"the launcher (pid {proc.pid}) died; workers stopped"
    assert_nothing_committed(store, run)


@pytest.mark.slow
def test_sigterm_of_the_launcher_stops_its_workers_and_marks_the_run_interrupted(store: Path) -> None:
    proc = start(train_command(store, "--rounds", 100000))
    try:
        family = wait_for_training(proc, store)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert proc.returncode not in (0, None, -signal.SIGTERM)  # handled: the launcher cleaned up and exited
        assert_all_gone(family)
    finally:
        if proc.poll() is None:
            proc.kill()
    run = the_run(store)
    last = last_event(Store(store), run)
    assert last is not None and (last["event"], last["detail"]) == ("interrupted", "stopped by SIGTERM")
    assert_nothing_committed(store, run)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["start-up", "training"])
def test_a_stopped_worker_is_named_by_its_rank_within_the_hang_timeout(store: Path, phase: str) -> None:
    """SIGSTOP of rank 1 as soon as it is spawned (before the process group forms), or once
    training is under way: the run fails naming rank 1, long before the 300 s collective timeout."""
    hang_s, collective_s = 5, 300
    proc = start(train_command(store, "--rounds", 100000, "--hang-timeout", hang_s, "--timeout", collective_s))
    victim = None
    try:
        parent = psutil.Process(proc.pid)
        if phase == "training":
            wait_for_training(proc, store)
        deadline = time.monotonic() + 120
        while len(found := worker_processes(parent)) < WORKERS:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        victim = found[1]  # rank 1: ranks are started in order
        victim.suspend()
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    message = flat(err)
    if phase == "start-up":
        assert "error: worker rank 1 never joined the process group: it stopped responding" in message
    else:
        assert "error: worker rank 1 stopped responding during training" in message
    assert f"(no heartbeat and no CPU time for {hang_s} s" in message
    assert "rank 0" not in message
    assert len(err.strip().splitlines()) == 1, err
    assert elapsed < collective_s / 5  # a bound: the collective timeout did not have to expire
    assert_all_gone([victim])  # the launcher killed the stopped worker too
    assert last_event(Store(store), the_run(store))["event"] == "failed"  # type: ignore[index]
    assert_nothing_committed(store, the_run(store))


@pytest.mark.slow
def test_two_identical_trains_train_each_layer_once(store: Path) -> None:
    """The second train waits for the first one's layer locks, then finds the layers committed:
    it reports them cached, starts no worker, and the first run's layer folders stay as they are."""
    command = train_command(store, "--rounds", "800,20")
    first = start(command)
    second = None
    try:
        wait_for_training(first, store, started=False)  # its workers run: it holds the layers' locks
        second = start(command)
        watched = psutil.Process(second.pid)
        second_spawned: list[str] = []
        committed: dict[int, tuple[int, str]] = {}  # layer -> (inode of model.pt, manifest) when first seen
        deadline = time.monotonic() + BOTH_TRAINED_S
        while second.poll() is None or first.poll() is None:
            assert time.monotonic() < deadline, "the two trains did not end in time"
            try:
                second_spawned += [" ".join(c.cmdline()) for c in worker_processes(watched)]
            except psutil.NoSuchProcess:
                pass
            for layer in (1, 2):
                folder = store / "runs" / f"run={the_run(store)}" / f"layer={layer}"
                if layer not in committed and (folder / MANIFEST).is_file():
                    committed[layer] = ((folder / "model.pt").stat().st_ino, (folder / MANIFEST).read_text())
            time.sleep(0.1)
        outputs = communicate_all([first, second], timeout=60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert [first.returncode, second.returncode] == [0, 0], outputs
    states = [[row[1] for row in table_rows(out) if row[0] in ("1", "2")][:2] for out, _ in outputs]
    assert states == [["trained", "trained"], ["cached", "cached"]], outputs
    assert second_spawned == []
    run_dir = store / "runs" / f"run={the_run(store)}"
    for layer, (inode, manifest) in committed.items():
        assert (run_dir / f"layer={layer}" / "model.pt").stat().st_ino == inode
        assert (run_dir / f"layer={layer}" / MANIFEST).read_text() == manifest
    assert sorted(committed) == [1, 2]
    # the race was real: the second train had started (and asked for the layers) before the
    # first one committed its last layer
    events = sorted((run_dir / "events").glob("*.json"))
    names = [e.name.rsplit("-", 1)[1].removesuffix(".json") for e in events]
    assert names == ["started", "started", "completed", "completed"], names
    second_started = json.loads(events[1].read_text())["happened_at"]
    assert second_started < json.loads(committed[2][1])["created_at"], "the second train came too late to race"


@pytest.mark.slow
def test_more_worker_processes_than_the_ceiling_are_refused_before_anything_starts(store: Path) -> None:
    before = sorted(p.name for p in store.glob("partitions/*/*"))
    capped = run_cli("train", "cora", "--parts", 9, store=store, env={"RETEXO_MAX_WORKERS": "8"})
    default = run_cli("train", "cora", "--parts", 2708, store=store)
    for result, parts in ((capped, 9), (default, 2708)):
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"error: {parts} worker processes would exceed this machine's ceiling of " in result.stderr
        assert "use fewer --parts" in result.stderr and "RETEXO_MAX_WORKERS" in result.stderr
    assert "ceiling of 8 (RETEXO_MAX_WORKERS=8)" in capped.stderr
    assert sorted(p.name for p in store.glob("partitions/*/*")) == before  # no partition was built
    assert not (store / "runs").exists()  # no run was started
    bad = run_cli("train", "cora", "--parts", 2, store=store, env={"RETEXO_MAX_WORKERS": "many"})
    assert bad.returncode == 2 and "RETEXO_MAX_WORKERS must be a positive whole number" in bad.stderr


def test_a_run_left_started_without_a_holder_is_marked_by_gc_and_by_the_next_run(tiny, tmp_path: Path) -> None:
    store, dataset, partition = tiny
    # store gc: a run left "started" by a dead launcher is marked; one held by a live process is not
    gc_store = Store.open(tmp_path / "gc-store")
    record_run_event(gc_store, "0123abandoned", "started", "retexo")
    record_run_event(gc_store, "4567running", "started", "retexo")
    with hold_run(gc_store, "4567running"):
        result = run_cli("store", "gc", store=gc_store.root)
        assert result.returncode == 0, result.stderr
        assert last_event(gc_store, "4567running")["event"] == "started"  # type: ignore[index]
        assert "run 0123abandoned: its launcher is gone; marked interrupted" in result.stdout
        assert "4567running" not in result.stdout
    last = last_event(gc_store, "0123abandoned")
    assert last is not None and (last["event"], last["detail"]) == ("interrupted", ABANDONED)
    # the next run of it: "interrupted" first, then its own events
    from runner.lifecycle import run_training

    plan = plan_run(store, dataset, partition, small_config(seed=11), NetworkModel())
    record_run_event(store, plan.run_fp, "started", "retexo")
    run_training(plan, IN_PROCESS)
    events = sorted((store.run_dir(plan.run_fp) / "events").glob("*.json"))
    names = [e.name.rsplit("-", 1)[1].removesuffix(".json") for e in events]
    assert names == ["started", "interrupted", "started", "completed"]


def flow_run_states(env: dict[str, str]) -> dict[str, str]:
    """Flow run name -> state name, read from the Prefect database of ``env`` (its PREFECT_HOME).

    Read from the file, not through a client: with no API URL a client starts a temporary server
    on a port it finds free, and under parallel test workers another worker's temporary server can
    take that port in between, so the client read another Prefect home (an empty list)."""
    database = Path(env["PREFECT_HOME"]) / "prefect.db"
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=60)) as connection:
        return dict(connection.execute("SELECT name, state_name FROM flow_run").fetchall())


@pytest.mark.slow
def test_sigkill_of_retexo_run_stops_everything_and_the_next_run_marks_its_flow_run_crashed(
        store: Path, tmp_path: Path) -> None:
    """Workers, Prefect's temporary API server and the guard are gone within 10 s; the flow run
    left RUNNING is set to Crashed by the next ``retexo run`` on the same Prefect home."""
    env = {**cli_env(), "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"dataset: {{name: cora, source: planetoid, path: {CORA_DIR}}}\n"
                      f"partition: {{method: random, parts: {WORKERS}}}\n"
                      "train: {hidden: 16, rounds: 100000, timeout_s: 60}\n")
    proc = subprocess.Popen([*RETEXO, "run", str(preset), "--store", str(store)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    family = sigkill_once_training(proc, store)
    assert any("uvicorn" in command for command in family), family  # Prefect's temporary server
    assert list(flow_run_states(env).values()) == ["Running"]
    again = run_cli("run", preset, "--set", "train.rounds=2", store=store, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "left RUNNING by a process that died: marked Crashed" in again.stderr
    assert sorted(flow_run_states(env).values()) == ["Completed", "Crashed"]


@pytest.mark.slow
@pytest.mark.parametrize("settings,message", [
    ({"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"},
     "the temporary Prefect API server did not start within 1 s"),
    ({"PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_CLIENT_MAX_RETRIES": "0"},
     "cannot reach the Prefect API at http://127.0.0.1:9/api"),
])
def test_a_prefect_api_that_cannot_start_or_be_reached_is_one_line_and_nothing_is_left(
        tmp_path: Path, settings: dict[str, str], message: str) -> None:
    env = {**cli_env(), "PREFECT_HOME": str(tmp_path / "prefect-home"), **settings}
    if "PREFECT_API_URL" not in settings:
        env.pop("PREFECT_API_URL", None)
    result = run_cli("run", REPO / "configs" / "cora_gcn.yaml", store=tmp_path / "store", env=env, timeout=180)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr
    deadline = time.monotonic() + GONE_S  # the temporary server started for the first case is stopped
    while (servers := [p for p in psutil.process_iter(["cmdline", "environ"])
                       if "uvicorn" in " ".join(p.info["cmdline"] or [])
                       and (p.info["environ"] or {}).get("PREFECT_HOME") == env["PREFECT_HOME"]]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not servers
