"""``--normalize-features auto``: the recipe chosen on validation.

Layer-wise training trains layer 1 on raw and on row-normalised features from its one halo
exchange and keeps the one that wins on validation by the search's margin (``--recipe-margin``);
end-to-end strategies train the whole model on each. On Cora (non-negative bag-of-words, 4 random
parts, ranks as threads): the chosen candidate is exactly the run with that normalisation fixed
(the same embeddings bit for bit, so the search is deterministic for a seed), and its bytes are
the fixed run's plus one more layer-1 candidate's gradient and validation traffic and one paired
comparison, nothing more: no second halo exchange.
"""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch

from retexo_core.models import Block, LayerWithHead
from training_helpers import comm_log, params, small_config, train

PARTS = 4
HIDDEN = 8
CLASSES = 7
CORA_VAL = 500  # validation nodes of Cora's public split


def ring(nbytes: int) -> int:
    """Bytes all ranks together send for a ring all-reduce of ``nbytes``."""
    return 2 * (PARTS - 1) * nbytes


PAIRED = ring(8 * 2)  # an alternative against the kept candidate: (gained, lost), float64


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


def test_layer_1_keeps_the_candidate_that_wins_on_validation_by_the_margin(searched) -> None:
    runs, _ = searched
    recipe = layer_manifest(runs["auto"], 1)["recipe"]
    scores = {c["features"]: c["val"] for c in recipe["val_scores"]}
    fixed = {mode: layer_manifest(runs[mode], 1)["best_val"] for mode in ("none", "rows")}
    assert scores == fixed
    gained, lost = recipe["val_scores"][1]["gained"], recipe["val_scores"][1]["lost"]
    assert gained - lost == round((scores["rows"] - scores["none"]) * CORA_VAL)  # nodes, paired at the best rounds
    best = "rows" if gained - lost > 0 else "none"  # margin 0 (the default): any higher accuracy; none wins ties
    assert recipe["features"] == best
    assert "val_scores" not in layer_manifest(runs["auto"], 2)["recipe"]  # later layers have one candidate
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
    assert auto["control"] - fixed["control"] == rounds[0] * split_stats + PAIRED


def test_an_end_to_end_strategy_keeps_the_whole_model_trained_with_the_better_normalisation(cora) -> None:
    runs = {mode: train(cora.store, cora.dataset, None,
                        small_config(strategy="centralized", hidden=HIDDEN, epochs=5, normalize_features=mode))
            for mode in ("auto", "rows", "none")}
    recipe = layer_manifest(runs["auto"], 1)["recipe"]
    scores = {c["features"]: c["val"] for c in recipe["val_scores"]}
    assert scores == {mode: layer_manifest(runs[mode], 1)["best_val"] for mode in ("none", "rows")}
    chosen = recipe["features"]
    gained, lost = recipe["val_scores"][1]["gained"], recipe["val_scores"][1]["lost"]
    assert gained - lost == round((scores["rows"] - scores["none"]) * CORA_VAL)
    assert chosen == ("rows" if gained - lost > 0 else "none")
    for layer in (1, 2):
        assert layer_manifest(runs["auto"], layer)["recipe"] == recipe
    for layer in (1, 2):
        models = [torch.load(runs[m].store.run_dir(runs[m].run_fp) / f"layer={layer}" / "model.pt")
                  for m in ("auto", chosen)]
        assert models[0].keys() == models[1].keys()
        assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


# --recipe auto: the greedy knob-by-knob search ------------------------------------------------

SCREEN = 2


def candidate_module(knobs: dict, in_dim: int, out_dim: int, last: bool) -> LayerWithHead:
    return LayerWithHead(Block("gcn", in_dim, out_dim, 4, 0.0, last=last, norm=knobs["norm"] == "layer",
                               skip=knobs["skip"]), CLASSES)


@pytest.fixture(scope="module")
def auto_runs(cora, tmp_path_factory):
    """Retexo on Cora with the whole search (margin 1), twice in two stores (the same seed), and
    once with the searched run's recipe.json as a recipe file."""
    from graphstore.layout import Store
    from graphstore.ingest.api import ingest_planetoid
    from graphstore.partition.build import build_partition
    from graphstore.partition.methods import PartitionOptions
    from conftest import CORA_DIR

    config = small_config(hidden=HIDDEN, rounds=[5, 4], recipe="auto", recipe_screen=SCREEN, recipe_margin=1.0)
    first = train(cora.store, cora.dataset, cora.partitions["random"], config)
    other = Store.open(tmp_path_factory.mktemp("again") / "store")
    dataset = ingest_planetoid(other, CORA_DIR, "cora")
    again = train(other, dataset, build_partition(other, dataset, PartitionOptions(method="random", parts=4, seed=0)),
                  config)
    recipe_file = first.store.run_dir(first.run_fp) / "recipe.json"
    fixed = train(cora.store, cora.dataset, cora.partitions["random"],
                  small_config(hidden=HIDDEN, rounds=[5, 4], recipe=str(recipe_file)))
    return first, again, fixed, [5, 4]


def test_the_search_is_deterministic_for_a_seed(auto_runs) -> None:
    first, again, _, _ = auto_runs
    for layer in (1, 2):
        assert layer_manifest(first, layer)["recipe"] == layer_manifest(again, layer)["recipe"]
        for part in range(PARTS):
            tables = [pq.read_table(p.store.run_dir(p.run_fp) / f"layer={layer}" / f"part={part}" / "embeddings.parquet")
                      for p in (first, again)]
            assert tables[0].equals(tables[1])
    assert comm_log(first) == comm_log(again)


def test_the_search_tries_every_knob_in_turn_and_keeps_one_better_by_the_margin(auto_runs) -> None:
    first, _, _, _ = auto_runs
    recipe = layer_manifest(first, 1)["recipe"]
    tried = recipe["val_scores"]
    scores = ("val", "gained", "lost")
    # start (small_config: dropout 0, lr 0.05), then skip, features, norm, dropout x2, lr x2 (layer 1 keeps its decay)
    assert [sorted(k for k in t if k not in scores and t[k] != tried[0][k]) for t in tried][:2] == [[], ["skip"]]
    assert len(tried) == 8
    best = tried[0]
    for t in tried[1:]:  # each against the one kept when it trained
        assert t["gained"] - t["lost"] == round((t["val"] - best["val"]) * CORA_VAL)
        if t["gained"] - t["lost"] > math.sqrt(t["gained"] + t["lost"]):
            best = t
    assert {k: recipe[k] for k in best if k not in scores} == {k: v for k, v in best.items() if k not in scores}
    assert len(layer_manifest(first, 2)["recipe"]["val_scores"]) == 1 + 1 + 1 + 2 + 2  # skip, decay, dropout, lr


def test_the_search_bytes_are_the_analytic_count(auto_runs) -> None:
    """Halo traffic of one exchange per layer; gradients and validation of every round every
    candidate trained: ``recipe_screen`` rounds each, and the kept one the layer's full rounds;
    one paired comparison per alternative."""
    first, _, fixed, rounds = auto_runs
    searched = comm_log(first)
    split_stats = ring(8 * 9)  # every round validates (eval_every 1)
    grad = control = 0
    for layer, (in_dim, out_dim) in ((1, (1433, HIDDEN)), (2, (HIDDEN, CLASSES))):
        recipe = layer_manifest(first, layer)["recipe"]
        kept = {k: v for k, v in recipe.items() if k != "val_scores"}
        kept_index = next(i for i, t in enumerate(recipe["val_scores"]) if {k: t[k] for k in kept} == kept)
        for i, tried in enumerate(recipe["val_scores"]):
            trained = rounds[layer - 1] if i == kept_index else SCREEN
            grad += trained * ring(4 * params(candidate_module(tried, in_dim, out_dim, layer == 2)))
            control += trained * split_stats + (PAIRED if i else 0)
    setup = comm_log(fixed)["control"] - sum(r * split_stats for r in rounds)
    assert searched["grad_sync"] == grad
    assert searched["control"] == control + setup
    assert searched["halo_features"] == comm_log(fixed)["halo_features"]
    assert searched["halo_embeddings"] == comm_log(fixed)["halo_embeddings"]


def test_a_recipe_file_trains_exactly_the_kept_models(auto_runs) -> None:
    """The searched run's recipe.json as --recipe FILE: the same layers bit for bit, with the
    kept candidates' traffic only."""
    first, _, fixed, rounds = auto_runs
    for layer in (1, 2):
        kept = {k: v for k, v in layer_manifest(first, layer)["recipe"].items() if k != "val_scores"}
        assert layer_manifest(fixed, layer)["recipe"] == kept
        for part in range(PARTS):
            tables = [pq.read_table(p.store.run_dir(p.run_fp) / f"layer={layer}" / f"part={part}" / "embeddings.parquet")
                      for p in (first, fixed)]
            assert tables[0].equals(tables[1])
    p = [params(candidate_module(layer_manifest(fixed, l)["recipe"], i, o, l == 2))
         for l, (i, o) in ((1, (1433, HIDDEN)), (2, (HIDDEN, CLASSES)))]
    assert comm_log(fixed)["grad_sync"] == sum(r * ring(4 * q) for r, q in zip(rounds, p))


def test_an_alternative_replaces_the_kept_recipe_only_beyond_the_margin() -> None:
    from retexo_core.recipe import GreedySearch

    def replaced(margin: float, paired: tuple[int, int] | None, score: float = 0.81) -> bool:
        search = GreedySearch({"dropout": 0.5}, ["dropout"], layer=2, end_to_end=False, margin=margin)
        search.next()
        search.report(0.80)
        assert search.next() is not None
        return search.report(score, paired)

    assert replaced(1.0, (10, 4))  # 6 more nodes right > sqrt(14) = 3.7
    assert not replaced(1.0, (6, 3))  # 3 > sqrt(9) = 3 fails: within one standard error
    assert replaced(0.0, (6, 3)) and not replaced(0.0, (3, 3))  # margin 0: any higher accuracy
    assert replaced(1.0, None) and not replaced(1.0, None, 0.80)  # no paired counts (ROC-AUC): a higher score


def test_a_bad_recipe_file_is_one_line_naming_the_file_and_the_field(tmp_path) -> None:
    from retexo_core.config import TrainConfig

    bad = tmp_path / "recipe.json"
    bad.write_text(json.dumps({"layers": {"1": {"dropout": 2}}}))
    with pytest.raises(ValueError, match=r"recipe.json: layers.1.dropout: 2 is not a valid value"):
        TrainConfig(recipe=str(bad))
    bad.write_text(json.dumps({"layers": {"1": {"depth": 3}}}))
    with pytest.raises(ValueError, match=r"layers.1.depth: unknown knob"):
        TrainConfig(recipe=str(bad))
    with pytest.raises(ValueError, match=r"missing.json: recipe file not found"):
        TrainConfig(recipe=str(tmp_path / "missing.json"))


# a distributed end-to-end strategy: the same knobs as centralized -------------------------------

def test_end_to_end_candidates_train_in_full_unless_a_shorter_screen_is_given() -> None:
    from retexo_core.config import TrainConfig

    assert TrainConfig(strategy="standard").screen_epochs is None
    assert TrainConfig(strategy="standard", recipe_screen=50).screen_epochs == 50
    assert TrainConfig(strategy="tma", recipe_screen=200, epochs=200).screen_epochs is None
    assert TrainConfig(strategy="centralized", recipe_screen=20).screen_epochs == 20


def test_standard_screens_every_knob_then_trains_the_kept_recipe_in_full(cora) -> None:
    """``standard`` under ``--recipe auto`` with ``--recipe-screen`` tries every knob, each
    candidate ``recipe_screen`` epochs, then trains the kept recipe ``epochs`` from the same start:
    that model is bit for bit the one its recipe file trains, and the bytes are every candidate's
    epochs of the file's run."""
    from retexo_core.models import build_blocks

    epochs, screen = 5, 2
    options = dict(strategy="standard", hidden=HIDDEN, epochs=epochs, recipe_screen=screen)
    searched = train(cora.store, cora.dataset, cora.partitions["random"], small_config(**options, recipe="auto"))
    recipe = layer_manifest(searched, 1)["recipe"]
    tried = recipe["val_scores"]
    # features, skip, norm, decay, then dropout and lr from small_config's 0 and 0.05 to both of their values
    assert len(tried) == 1 + 4 + 2 + 2
    assert layer_manifest(searched, 1)["rounds"] == epochs  # the kept recipe's full training
    recipe_file = searched.store.run_dir(searched.run_fp) / "recipe.json"
    fixed = train(cora.store, cora.dataset, cora.partitions["random"], small_config(**options, recipe=str(recipe_file)))
    for layer in (1, 2):
        models = [torch.load(p.store.run_dir(p.run_fp) / f"layer={layer}" / "model.pt") for p in (searched, fixed)]
        assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])

    def size(knobs: dict) -> int:
        return params(build_blocks("gcn", 1433, HIDDEN, CLASSES, 2, 4, 0.0, norm=knobs["norm"] == "layer",
                                   skip=knobs["skip"]))

    kept = {k: v for k, v in recipe.items() if k != "val_scores"}
    searched_log, fixed_log = comm_log(searched), comm_log(fixed)
    assert fixed_log["grad_sync"] == epochs * ring(4 * size(kept))
    assert searched_log["grad_sync"] == sum(screen * ring(4 * size(t)) for t in tried) + fixed_log["grad_sync"]
    assert searched_log["halo_grads"] * epochs == fixed_log["halo_grads"] * (len(tried) * screen + epochs)
    assert searched_log["halo_features"] == fixed_log["halo_features"] * (len(tried) + 1)  # once per training
