"""Model averaging with drift correction (``--sync avg --drift-correction``, ``common.DriftCorrection``).

On Cora cut by METIS into 4 parts (ranks as threads, dropout off, the default recipe, no search):

- with averaging after every round, the corrected local step's gradient is the whole graph's
  gradient at the averaged model, so every rank takes gradient sync's Adam step: the run keeps
  gradient sync's parameters (to float rounding) and validation scores, layer by layer and in the
  last two layers trained together, where plain averaging after every round does not;
- the correction costs one all-reduce of the parameters (``grad_sync``) before the first local step
  after each averaging, so it sends exactly as many ``grad_sync`` bytes as ``model_sync`` bytes, and
  the same ``model_sync`` bytes as plain averaging;
- it is refused without ``sync avg``.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from retexo_core.config import TrainConfig
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

    return {"grad": run(sync="grad"), "avg": run(sync="avg", sync_every=1),
            "avg+dc": run(sync="avg", sync_every=1, drift_correction=True),
            "avg/2": run(sync="avg", sync_every=2), "avg/2+dc": run(sync="avg", sync_every=2, drift_correction=True)}


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
