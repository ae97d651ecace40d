"""``--normalize-features auto``: the recipe chosen on validation.

Layer-wise training trains layer 1 on raw and on row-normalised features from its one halo
exchange and keeps the better on validation; end-to-end strategies train the whole model on each. On Cora (non-negative bag-of-words, 4 random parts, ranks as threads): the chosen
candidate is exactly the run with that normalisation fixed (the same embeddings bit for bit, so
the search is deterministic for a seed), and its bytes are the fixed run's plus one more layer-1 candidate's
gradient and validation traffic, nothing more: no second halo exchange.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from retexo_core.models import Block, LayerWithHead
from training_helpers import comm_log, params, small_config, train

PARTS = 4
HIDDEN = 8
CLASSES = 7


def ring(nbytes: int) -> int:
    """Bytes all ranks together send for a ring all-reduce of ``nbytes``."""
    return 2 * (PARTS - 1) * nbytes


def layer_manifest(plan, layer: int) -> dict:
    return json.loads((plan.store.run_dir(plan.run_fp) / f"layer={layer}" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def searched(cora):
    """Retexo on Cora with the search, and with each normalisation fixed."""
    rounds = [4, 3]
    runs = {mode: train(cora.store, cora.dataset, cora.partitions["random"],
                        small_config(hidden=HIDDEN, rounds=rounds, lr=0.01, normalize_features=mode))
            for mode in ("auto", "rows", "none")}
    return runs, rounds


def test_layer_1_keeps_the_candidate_with_the_better_validation_score(searched) -> None:
    runs, _ = searched
    recipe = layer_manifest(runs["auto"], 1)["recipe"]
    scores = {c["normalize_features"]: c["val"] for c in recipe["val_scores"]}
    fixed = {mode: layer_manifest(runs[mode], 1)["best_val"] for mode in ("none", "rows")}
    assert scores == fixed
    best = "rows" if scores["rows"] > scores["none"] else "none"  # the default (none) wins ties
    assert recipe["normalize_features"] == best
    assert layer_manifest(runs["auto"], 2)["recipe"] == {}  # later layers have one candidate
    chosen = runs[best].store.run_dir(runs[best].run_fp)
    searched_dir = runs["auto"].store.run_dir(runs["auto"].run_fp)
    for layer in (1, 2):
        for part in range(PARTS):
            ours = pq.read_table(searched_dir / f"layer={layer}" / f"part={part}" / "embeddings.parquet")
            theirs = pq.read_table(chosen / f"layer={layer}" / f"part={part}" / "embeddings.parquet")
            assert ours.equals(theirs)  # bitwise: the search changes which model, not the model


def test_the_search_costs_one_more_candidate_of_gradients_and_validation_and_no_halo_traffic(searched) -> None:
    runs, rounds = searched
    auto, fixed = comm_log(runs["auto"]), comm_log(runs["rows"])
    p1 = params(LayerWithHead(Block("gcn", 1433, HIDDEN, 4, 0.0, last=False), CLASSES))
    split_stats = ring(8 * 9)  # (loss, correct, count) x (train, val, test), float64, every round
    assert auto["halo_features"] == fixed["halo_features"]
    assert auto["halo_embeddings"] == fixed["halo_embeddings"]
    assert auto["grad_sync"] - fixed["grad_sync"] == rounds[0] * ring(4 * p1)
    assert auto["control"] - fixed["control"] == rounds[0] * split_stats


def test_an_end_to_end_strategy_keeps_the_whole_model_trained_with_the_better_normalisation(cora) -> None:
    runs = {mode: train(cora.store, cora.dataset, None,
                        small_config(strategy="centralized", hidden=HIDDEN, epochs=5, normalize_features=mode))
            for mode in ("auto", "rows", "none")}
    recipe = layer_manifest(runs["auto"], 1)["recipe"]
    scores = {c["normalize_features"]: c["val"] for c in recipe["val_scores"]}
    assert scores == {mode: layer_manifest(runs[mode], 1)["best_val"] for mode in ("none", "rows")}
    chosen = recipe["normalize_features"]
    assert chosen == ("rows" if scores["rows"] > scores["none"] else "none")
    for layer in (1, 2):
        assert layer_manifest(runs["auto"], layer)["recipe"] == recipe
    for layer in (1, 2):
        models = [torch.load(runs[m].store.run_dir(runs[m].run_fp) / f"layer={layer}" / "model.pt")
                  for m in ("auto", chosen)]
        assert models[0].keys() == models[1].keys()
        assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
