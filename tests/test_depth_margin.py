"""``benchmarks/depth_margin.py`` reads both depths' predictions from the store: its per-node results
give each run's stored validation and test accuracy, and with margin 0 it keeps the depth that the
depth choice keeps. Its job processes end with it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
from processes import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from depth_margin import correct_by_split, keeps_deeper, paired_table, share_right  # noqa: E402
from search_margin import half_a_only, in_half_b, nested  # noqa: E402

from retexo_core.comm.network import NetworkModel  # noqa: E402
from retexo_core.data import load_part  # noqa: E402
from runner.depth import depth_choice  # noqa: E402
from runner.lifecycle import run_training  # noqa: E402
from runner.plan import plan_run  # noqa: E402
from training_helpers import IN_PROCESS, small_config  # noqa: E402


def test_the_per_node_results_are_the_stored_scores_and_margin_0_is_the_depth_choice(tiny) -> None:
    store, dataset, partition = tiny
    for seed in (4, 5, 6):
        plan = plan_run(store, dataset, partition, small_config(choose_depth=True, seed=seed), NetworkModel())
        run_training(plan, IN_PROCESS)
        choice = depth_choice(plan)
        depths = {"shallower": choice.shallower, "deeper": choice.deeper}
        run = {name: correct_by_split(store, manifest) for name, manifest in depths.items()}
        for name, manifest in depths.items():
            assert share_right(run[name]["val"]) == manifest.accuracy("val")
            assert share_right(run[name]["test"]) == manifest.accuracy("test")
        assert (choice.kept is choice.deeper) == keeps_deeper(run, 0.0)


def test_the_validation_protocols_split_validation_and_keep_the_train_split(tiny) -> None:
    """``halves``: half A validates, half B tests; ``half-a``: half A validates, the test split tests."""
    data = load_part(tiny[2].path, 0)
    val, test, half_b = data.masks["val"], data.masks["test"], in_half_b(data.node_id)
    assert (val & half_b).any() and (val & ~half_b).any()
    halves, half_a = nested(data), half_a_only(data)
    assert halves.masks["val"].equal(val & ~half_b) and halves.masks["test"].equal(val & half_b)
    assert half_a.masks["val"].equal(val & ~half_b) and half_a.masks["test"].equal(test)
    for split in (halves, half_a):
        assert split.masks["train"].equal(data.masks["train"])


def a_run(variant: str, seed: int, half_b: str) -> dict:
    """A run of ``--out`` whose two depths are alike: half A all right, half B as given."""
    depth = {"val": "1111", "test": half_b}
    return {"graph": "cora", "model": "gcn", "variant": variant, "seed": seed, "layers": 2,
            "shallower": depth, "deeper": depth}


def test_runs_pair_with_another_variants_runs_of_the_same_seed_only_when_asked() -> None:
    layerwise = [a_run("centralized --layerwise", 0, "1100"), a_run("centralized --layerwise", 1, "1000")]
    end_to_end = [a_run("centralized", 0, "1110"), a_run("centralized", 1, "1110"), a_run("centralized", 2, "0000")]
    assert paired_table(layerwise, end_to_end, 0.0)[2:] == ["", "no run of these has a partner in the other arm"]
    row = paired_table(layerwise, end_to_end, 0.0, against_variant="centralized")[2]
    # seeds 0 and 1 pair (seed 2 has no partner); half B per seed: -25 and -50 points
    assert row == ("| cora | gcn | centralized --layerwise | 2 | 1.000 / 0.750 | 1.000 / 0.375 | +0.00 ± 0.00 "
                   "| -37.50 ± 12.50 | 2 of 2 |")


# a benchmark's pool as depth_margin.py and search_margin.py start it: one worker, busy in a job
STOPPED_BENCHMARK = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, "benchmarks")
import search_margin
if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=search_margin.start_worker)
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 120)
    time.sleep(120)
"""


def still_running(process: psutil.Process) -> bool:
    """Whether ``process`` exists and has not exited (an exited orphan may stay a zombie a moment)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_benchmark_leaves_no_worker_training_on() -> None:
    """SIGKILL a benchmark mid-job: its spawned worker ends with it (``search_margin.start_worker``
    asks the kernel for that), instead of finishing its run as an orphan."""
    benchmark = subprocess.Popen([sys.executable, "-c", STOPPED_BENCHMARK], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(benchmark.stdout.readline()))
        time.sleep(1)  # the worker takes the sleeping job
        benchmark.kill()
        benchmark.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and still_running(worker):
            time.sleep(0.2)
        orphaned = still_running(worker)
        if orphaned:
            worker.kill()
        assert not orphaned
    finally:
        benchmark.kill()
        benchmark.wait(10)
