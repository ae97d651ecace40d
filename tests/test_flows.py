"""The Prefect pipeline: cached re-runs, partial changes, deleted artefacts, failures and retries,
config validation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import REPO, prefect_test_server, run_cli, table_rows
from flows.params import PipelineParams

# one worker runs the whole module: its tests share the temporary Prefect server below
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.slow,
              pytest.mark.xdist_group("prefect-flows")]


@pytest.fixture(scope="module", autouse=True)
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server (SQLite in a temp folder) for this module's flow runs."""
    with prefect_test_server():
        yield


def params(store: Path, network: dict[str, object] | None = None, **train: object) -> PipelineParams:
    return PipelineParams.model_validate({
        "store": str(store),
        "dataset": {"name": "sbm", "source": "synthetic",
                    "synthetic": {"nodes": 200, "avg_degree": 6, "classes": 3, "features": 8, "seed": 0}},
        "partition": {"method": "random", "parts": 2},
        "train": {"hidden": 8, "rounds": [3, 3], "timeout_s": 60, **train},
        "network": network or {},
        "retries": 0,
    })


# Layer 2 of these runs really waits 5 ms per message step (the network model's sleep mode; the
# network is not part of the run's fingerprint), so that it lasts several seconds and a worker can
# be killed while it trains.
SLOW = {"mode": "sleep", "latency_ms": 5, "bandwidth_mbps": 1000}


def run(p: PipelineParams) -> dict[str, object]:
    from flows.pipeline import pipeline_flow

    return pipeline_flow(p)


def layer_mtimes(store: Path, run_fp: str) -> dict[str, float]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (store / "runs" / f"run={run_fp}").glob("layer=*/manifest.json")}


def test_second_identical_run_is_cached_and_a_layer2_change_retrains_only_layer2(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = run(params(store))
    assert first["stages"] == {"ingest": "written", "partition": "done", "layer 1": "trained",
                               "layer 2": "trained", "evaluate": "done"}
    before = layer_mtimes(store, first["run"])
    second = run(params(store))
    assert second["run"] == first["run"]
    # every stage's task finished in Prefect's "Cached" state (or, for ingest, found the dataset)
    assert second["stages"] == {"ingest": "cached", "partition": "cached", "layer 1": "cached",
                                "layer 2": "cached", "evaluate": "cached"}
    assert layer_mtimes(store, first["run"]) == before  # nothing was retrained or rewritten
    third = run(params(store, rounds=[3, 5]))
    assert third["stages"]["layer 1"] == "reused" and third["stages"]["layer 2"] == "trained"
    assert third["stages"]["evaluate"] == "done"
    manifest = json.loads((store / "runs" / f"run={third['run']}" / "manifest.json").read_text())
    assert manifest["layers"][0]["reused_from"] is not None


def test_a_depth_choice_trains_both_depths_and_reports_the_run_kept_on_validation(tmp_path: Path) -> None:
    """The baseline compared with the run trains at the depth the run kept."""
    store = tmp_path / "store"
    result = run(PipelineParams.model_validate({**params(store, rounds=3, epochs=20).model_dump(), "compare": ["standard"]}))
    assert {k: v for k, v in result["stages"].items() if k.startswith("layer")} == {
        "layer 1/2": "trained", "layer 2/2": "trained", "layer 1/3": "reused", "layer 2/3": "trained",
        "layer 3/3": "trained"}
    manifests = [json.loads(p.read_text()) for p in (store / "runs").glob("run=*/manifest.json")]
    runs = {len(m["layers"]): m for m in manifests if m["strategy"] == "retexo"}
    scores = {depth: next(r["accuracy"] for r in m["evaluation"] if r["split"] == "val") for depth, m in runs.items()}
    kept = 3 if scores[3] > scores[2] else 2
    assert result["run"] == runs[kept]["fp"] and f"run={result['run']}" in result["report"]
    (standard,) = [m for m in manifests if m["strategy"] == "standard"]  # one depth: the one kept
    assert result["compared"] == [standard["fp"]] and len(standard["layers"]) == kept


def test_deleting_an_artefact_makes_its_stage_run_again(tmp_path: Path) -> None:
    import shutil

    store = tmp_path / "store"
    first = run(params(store))
    shutil.rmtree(store / "runs" / f"run={first['run']}" / "layer=2")
    again = run(params(store))
    assert again["stages"]["layer 1"] == "cached"
    assert again["stages"]["layer 2"] == "trained"
    assert again["stages"]["evaluate"] == "done"  # the run summary is rebuilt for the new layer
    assert (store / "runs" / f"run={first['run']}" / "layer=2" / "manifest.json").is_file()


def is_worker(process: psutil.Process) -> bool:
    try:
        return "spawn_main" in " ".join(process.cmdline()) and process.is_running()
    except psutil.Error:  # exited meanwhile (zombie or gone)
        return False


def kill_a_worker_of_layer(store: Path, layer: int, done: threading.Event) -> None:
    """Once layer ``layer - 1`` is committed, kill one worker of the launch (one launch trains every
    pending layer, so the workers of layer ``layer`` are the ones that just committed the layer before)."""
    me = psutil.Process()
    deadline = time.monotonic() + 300
    while not list(store.glob(f"runs/run=*/layer={layer - 1}/manifest.json")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)
    while time.monotonic() < deadline:
        workers = [c for c in me.children(recursive=True) if is_worker(c)]
        if len(workers) >= 2:
            time.sleep(0.5)
            workers[-1].kill()
            done.set()
            return
        time.sleep(0.1)


def test_a_failed_run_resumes_at_the_first_unfinished_layer(tmp_path: Path) -> None:
    store = tmp_path / "store"
    killed = threading.Event()
    killer = threading.Thread(target=kill_a_worker_of_layer, args=(store, 2, killed), daemon=True)
    killer.start()
    with pytest.raises(Exception, match="killed by signal 9"):
        run(params(store, SLOW, rounds=[3, 400]))
    assert killed.is_set()
    resumed = run(params(store, rounds=[3, 400]))
    assert resumed["stages"]["layer 1"] == "cached" and resumed["stages"]["layer 2"] == "trained"


def test_a_task_retry_resumes_from_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    killed = threading.Event()
    threading.Thread(target=kill_a_worker_of_layer, args=(store, 2, killed), daemon=True).start()
    p = params(store, SLOW, rounds=[3, 400]).model_copy(update={"retries": 1, "retry_delay_s": 0})
    result = run(p)
    assert killed.is_set()
    assert result["stages"]["layer 2"] == "trained"
    assert (store / "runs" / f"run={result['run']}" / "manifest.json").is_file()


@pytest.mark.parametrize("override,key", [
    ("train.rounds=-3", "train.rounds"),
    ("train.modle=gcn", "train.modle"),
    ("partition.method=spectral", "partition.method"),
    ("network.bandwidth_mbps=0", "network.bandwidth_mbps"),
])
def test_a_bad_config_fails_before_any_work_naming_the_key(tmp_path: Path, override: str, key: str) -> None:
    store = tmp_path / "store"
    result = run_cli("run", REPO / "configs" / "cora_gcn.yaml", "--set", override, store=store)
    assert result.returncode == 2
    assert key in result.stderr
    assert not (store / "datasets").exists()


def test_the_demo_preset_prints_under_60_lines_and_ends_with_retexo_vs_standard(tmp_path: Path) -> None:
    """``retexo run configs/cora_gcn.yaml`` into a pipe (an 80-column terminal's COLUMNS set): a few
    progress lines per layer (and for the baseline's epochs) whose best val accuracy is the one the
    comparison table shows, the stages, and last the comparison table and the plot; no rank logs."""
    store = tmp_path / "store"
    result = run_cli("run", REPO / "configs" / "cora_gcn.yaml", "--set", "train.rounds=20", "--set", "train.epochs=20",
                     store=store, env={"COLUMNS": "80"}, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    assert len(lines) < 60, "\n".join(lines)
    assert not any("rank" in line or "round" in line or "…" in line for line in lines), "\n".join(lines)
    steps = [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith(("layer", "epochs"))]
    assert list(dict.fromkeys(steps)) == ["layer 1", "layer 2", "epochs"], result.stderr
    progress = {step: line for line in result.stderr.splitlines() for step in ("layer 2", "epochs")
                if line.startswith(f"{step}: ") and ", best val " in line}  # each step's last progress line
    # complete: layer 2 trains 20 rounds for each of its 5 recipe candidates (20 < --recipe-screen), then
    # 20 with layer 1 (the last two layers together) and 20 more from scratch (Cora: 5 % of the nodes
    # train); the baseline (standard: features, skip, norm, decay, dropout, lr) 20 epochs for each of its 7
    # candidates
    assert progress["layer 2"].startswith("layer 2: 140/140,") and progress["epochs"].startswith("epochs: 140/140,"), \
        result.stderr
    last_best = {step: line.split("best val ")[1].split()[0] for step, line in progress.items()}
    tail = result.stdout.splitlines()
    assert tail[-1].startswith("plot:") and Path(tail[-1].split(maxsplit=1)[1]).is_file()
    last_rows = tail[-4:-2]  # the table's two rows, then its bottom border, then the plot
    assert "retexo" in last_rows[0] and "standard" in last_rows[1], "\n".join(tail)
    table_val = {row[0]: round(float(row[3]), 3) for row in table_rows("\n".join(last_rows))}
    assert table_val == {"retexo": float(last_best["layer 2"]), "standard": float(last_best["epochs"])}, result.stderr
