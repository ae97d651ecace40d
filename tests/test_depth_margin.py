"""``benchmarks/depth_margin.py`` reads both depths' predictions from the store: its per-node results
give each run's stored validation and test accuracy, and with margin 0 it keeps the depth that the
depth choice keeps."""

from __future__ import annotations

import sys

from processes import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from depth_margin import correct_by_split, keeps_deeper, share_right  # noqa: E402

from retexo_core.comm.network import NetworkModel  # noqa: E402
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
