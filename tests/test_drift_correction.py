"""Model averaging with drift correction (``--sync avg --drift-correction``, ``common.DriftCorrection``).

On Cora cut by METIS into 4 parts (ranks as threads, dropout off, the default recipe, no search):

- with averaging after every round, the corrected local step's gradient is the whole graph's
  gradient at the averaged model, so every rank takes gradient sync's Adam step: the run keeps
  gradient sync's parameters (to float rounding) and validation scores, layer by layer and in the
  last two layers trained together, where plain averaging after every round does not;
- the correction costs one all-reduce of the parameters (``grad_sync``) before the first local step
  after each averaging, so it sends exactly as many ``grad_sync`` bytes as ``model_sync`` bytes, and
  the same ``model_sync`` bytes as plain averaging;
- it is refused without ``sync avg``;
- by default (neither flag) it is on where the ranks' train labels differ: on the METIS cut the
  run equals the corrected one and on the random cut the plain one, parameter for parameter, and
  the decision costs exactly two ``control`` all-reduces, of C + 1 values and of one;
- the test it decides on (``label_skew``) gives, from the ranks' sums, the statistic, p-value and
  bias-corrected Cramér's V of the whole table (as scipy and Bergsma's formula compute them), also
  when the sums are masked (``--secure-agg``).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from scipy.stats import chi2_contingency

from dist_helpers import run_threads
from retexo_core.comm.secure_agg import PairwiseMasks
from retexo_core.config import TrainConfig
from retexo_core.label_skew import label_skew, skew_of_table
from training_helpers import comm_log, small_config, train

LAYERS = 2
SETTINGS = dict(model="gcn", layers=LAYERS, rounds=4, lr=0.05, joint_rounds=3)


def layer_state(plan, layer: int) -> dict[str, torch.Tensor]:
    return torch.load(plan.store.run_dir(plan.run_fp) / f"layer={layer}" / "model.pt", weights_only=True)


def val_scores(plan, layer: int) -> list[float]:
    table = pq.read_table(plan.store.run_dir(plan.run_fp) / f"layer={layer}" / "metrics.parquet").to_pylist()
    return [r["acc"] for r in sorted(table, key=lambda r: r["round"]) if r["split"] == "val"]


@pytest.fixture(scope="module")
def runs(cora):
    def run(**options):
        return train(cora.store, cora.dataset, cora.partitions["metis"], small_config(**SETTINGS, **options))

    return {"grad": run(sync="grad"), "avg": run(sync="avg", sync_every=1, drift_correction=False),
            "avg+dc": run(sync="avg", sync_every=1, drift_correction=True),
            "avg/2": run(sync="avg", sync_every=2, drift_correction=False),
            "avg/2+dc": run(sync="avg", sync_every=2, drift_correction=True),
            "avg/2 auto": run(sync="avg", sync_every=2)}


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("layer", range(1, LAYERS + 1))
def test_averaging_every_round_with_the_correction_takes_gradient_syncs_steps(runs, layer) -> None:
    grad, corrected, plain = (layer_state(runs[k], layer) for k in ("grad", "avg+dc", "avg"))
    # g_i + (g - g_i) is g to float rounding, which Adam's normalised step enlarges: 1e-4 here, 0.3-0.5 without
    assert max_gap(corrected, grad) < 1e-3
    assert max_gap(plain, grad) > 0.1  # without the correction each rank steps along its own part's gradient
    assert val_scores(runs["avg+dc"], layer) == pytest.approx(val_scores(runs["grad"], layer), abs=1e-6)


def test_the_correction_sends_one_parameter_all_reduce_per_averaging(runs) -> None:
    for every in ("avg", "avg/2"):
        plain, corrected = comm_log(runs[every]), comm_log(runs[f"{every}+dc"])
        assert "grad_sync" not in plain
        assert corrected["model_sync"] == plain["model_sync"]
        assert corrected["grad_sync"] == corrected["model_sync"]
    assert comm_log(runs["avg/2"])["model_sync"] < comm_log(runs["avg"])["model_sync"]


def test_the_correction_needs_model_averaging() -> None:
    with pytest.raises(ValueError, match="drift_correction corrects the local steps of model averaging"):
        TrainConfig(strategy="retexo", sync="grad", drift_correction=True)


def decision(plan, layer: int) -> dict:
    manifest = json.loads((plan.store.run_dir(plan.run_fp) / f"layer={layer}" / "manifest.json").read_text())
    return manifest["recipe"]["drift_correction"]


def test_by_default_the_correction_is_on_where_the_ranks_labels_differ(cora, runs) -> None:
    auto, corrected = runs["avg/2 auto"], runs["avg/2+dc"]
    for layer in range(1, LAYERS + 1):  # METIS puts most of a class on one rank: corrected
        assert max_gap(layer_state(auto, layer), layer_state(corrected, layer)) == 0.0
        assert decision(auto, layer)["on"] and decision(auto, layer)["p_value"] < 1e-3
    random = {name: train(cora.store, cora.dataset, cora.partitions["random"],
                          small_config(**SETTINGS, sync="avg", sync_every=2, drift_correction=flag))
              for name, flag in (("auto", None), ("off", False))}
    for layer in range(1, LAYERS + 1):  # a random cut gives every rank the same mix: not corrected
        assert max_gap(layer_state(random["auto"], layer), layer_state(random["off"], layer)) == 0.0
        assert not decision(random["auto"], layer)["on"]
    parts, classes = 4, 7
    cost = 2 * (parts - 1) * ((classes + 1) + 1) * 8  # all-reduces of C + 1 float64 values, then of one
    for auto_run, fixed in ((auto, corrected), (random["auto"], random["off"])):
        assert comm_log(auto_run)["control"] - comm_log(fixed)["control"] == cost


@pytest.mark.parametrize("table", [
    [[30, 2, 1], [3, 25, 4], [2, 3, 28]],  # each class mostly on one rank
    [[10, 11, 9], [9, 10, 12], [11, 9, 10]],  # the same mix everywhere
    [[5, 0, 7, 1], [4, 0, 6, 2]],  # a class no rank has
    [[12, 3], [0, 0], [8, 9]],  # a rank without train nodes
])
def test_the_label_test_from_the_ranks_sums_is_that_of_the_whole_table(table) -> None:
    counts = np.array(table, dtype=np.float64)
    kept = counts[counts.sum(axis=1) > 0][:, counts.sum(axis=0) > 0]
    chi2, p_value, df, _ = chi2_contingency(kept, correction=False)
    n, (r, c) = kept.sum(), kept.shape
    phi2 = max(chi2 / n - (r - 1) * (c - 1) / (n - 1), 0.0)  # Bergsma (2013)
    v = np.sqrt(phi2 / min(r - (r - 1) ** 2 / (n - 1) - 1, c - (c - 1) ** 2 / (n - 1) - 1))
    whole = skew_of_table(counts)
    assert (whole.chi2, whole.df, whole.p_value, whole.cramers_v) == pytest.approx((chi2, df, p_value, v))
    labels = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in table]
    skews = [skew for skew, _ in run_threads(lambda comm: label_skew(comm, labels[comm.rank], len(table[0])),
                                             len(table))]
    for skew in skews:
        assert (skew.df, skew.nodes) == (whole.df, whole.nodes)
        assert (skew.chi2, skew.cramers_v) == pytest.approx((whole.chi2, whole.cramers_v))
    assert len({(s.chi2, s.differs) for s in skews}) == 1  # every rank reaches the same decision
    assert skews[0].differs == (table[0][0] == 30)


def test_under_secure_aggregation_the_class_counts_are_summed_masked() -> None:
    table = [[30, 2, 1], [3, 25, 4], [2, 3, 28]]
    labels = [torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in table]

    def masked(comm):
        comm.masks = PairwiseMasks.agree(comm)
        return label_skew(comm, labels[comm.rank], 3)

    whole = skew_of_table(np.array(table))
    for skew, rows in run_threads(masked, len(table)):
        assert skew.chi2 == pytest.approx(whole.chi2, abs=1e-6) and skew.differs == whole.differs
        kinds = {row[3] for row in rows}  # (op, layer, epoch, kind, rank, dst, bytes, hops)
        assert {"control", "secure_agg"} <= kinds  # the sums went as masked fixed point
