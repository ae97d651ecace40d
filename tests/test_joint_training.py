"""The last two layers trained together after the greedy layers (``strategies.joint``).

On Cora (4 random parts, ranks as threads, dropout off) with three layers, so that layer 2's inputs
(layer 1's embeddings) are dense rows of ``HIDDEN`` floats:

- the greedy layers are untouched: the joint run starts from exactly the model that the run
  without it keeps (the same validation score, computed from the exchanged aggregates);
- the one extra exchange is every rank's halo rows of layer 2's aggregated inputs, once: halo rows
  x HIDDEN x 4 B (twice that for SAGE, which also needs the node's own row), counted from the
  partition's halo lists;
- a launch that starts at the last layer (its hidden layers reused from the store) rebuilds layer
  2's inputs with its halo exchange made again and trains the pair exactly as the launch that
  trained every layer did;
- the last layer's stored model holds layer 2's jointly trained block exactly when the pair was kept.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from retexo_core.strategies.joint import HIDDEN_PREFIX
from runner.plan import plan_run, plan_site_run
from training_helpers import comm_log, small_config, train

HIDDEN = 8
PARTS = 4


def manifest(plan, layer: int) -> dict:
    return json.loads((plan.store.run_dir(plan.run_fp) / f"layer={layer}" / "manifest.json").read_text())


def halo_rows(partition) -> int:
    return sum(pq.read_metadata(partition.path / f"part={i}" / "halo.parquet").num_rows for i in range(PARTS))


@pytest.fixture(scope="module", params=["gcn", "sage"])
def runs(request, cora):
    # GCN: a skip connection in the last layer only, so that the pair's last block reads rows its
    # hidden block does not (layer 2's own rows are not sent)
    recipe = {"recipe": '{"layers": {"3": {"skip": true}}}'} if request.param == "gcn" else {}
    config = dict(model=request.param, hidden=HIDDEN, layers=3, rounds=[4, 3, 3], lr=0.05, **recipe)
    # 6: every layer in one launch; 0 and 7: layers 1-2 reused from it, the launch starts at layer 3
    return request.param, {rounds: train(cora.store, cora.dataset, cora.partitions["random"],
                                         small_config(**config, joint_rounds=rounds)) for rounds in (6, 0, 7)}


def test_the_joint_training_starts_from_the_greedy_model(runs) -> None:
    _, plans = runs
    greedy, joint = manifest(plans[0], 3), manifest(plans[6], 3)
    assert "joint" not in greedy["recipe"]
    assert joint["recipe"]["joint"]["start_val"] == greedy["best_val"]
    assert manifest(plans[7], 3)["recipe"]["joint"]["start_val"] == greedy["best_val"]
    for layer in (1, 2):  # the hidden layers are the same stages
        assert manifest(plans[6], layer)["fp"] == manifest(plans[0], layer)["fp"] == manifest(plans[7], layer)["fp"]


def test_a_launch_from_the_last_layer_trains_the_pair_as_one_launch_of_every_layer(runs) -> None:
    _, plans = runs

    def joint_rounds(plan) -> list[dict]:
        table = pq.read_table(plan.store.run_dir(plan.run_fp) / "layer=3" / "metrics.parquet").to_pylist()
        return [r for r in table if r["round"] >= 3]  # after the greedy layer's 3 rounds

    whole, resumed = joint_rounds(plans[6]), joint_rounds(plans[7])
    assert len(whole) == 6 * 3 and len(resumed) == 7 * 3  # train, val, test per round
    assert resumed[:len(whole)] == whole


@pytest.mark.parametrize("sync", ["grad", "avg"])
def test_the_pair_validates_every_round_with_gradient_sync_and_at_averaging_points_with_avg(sync, cora) -> None:
    """With ``eval_every`` 3: gradient sync validates all 6 rounds of the pair (its best rounds are
    few; see the module docstring), model averaging every 3 rounds only (where the ranks hold one
    model): rounds 5 and 8, after the greedy layer's 3 rounds."""
    config = small_config(model="gcn", hidden=HIDDEN, layers=2, rounds=3, lr=0.05, eval_every=3, sync=sync,
                          sync_every=3, joint_rounds=6)
    plan = train(cora.store, cora.dataset, cora.partitions["random"], config)
    table = pq.read_table(plan.store.run_dir(plan.run_fp) / "layer=2" / "metrics.parquet").to_pylist()
    validated = sorted({r["round"] for r in table if r["round"] >= 3})
    assert validated == ([3, 4, 5, 6, 7, 8] if sync == "grad" else [5, 8])


def test_the_extra_exchange_is_the_halo_rows_of_the_aggregated_inputs_once(runs, cora) -> None:
    model, plans = runs
    rows_sent = 2 if model == "sage" else 1  # SAGE also reads the node's own row
    assert comm_log(plans[6])["halo_aggregates"] == halo_rows(cora.partitions["random"]) * HIDDEN * 4 * rows_sent
    assert "halo_aggregates" not in comm_log(plans[0])


def test_the_stored_last_layer_holds_the_joint_hidden_block_when_kept(runs) -> None:
    import torch

    _, plans = runs
    joint = manifest(plans[6], 3)["recipe"]["joint"]
    state = torch.load(plans[6].store.run_dir(plans[6].run_fp) / "layer=3" / "model.pt", weights_only=True)
    hidden_keys = [k for k in state if k.startswith(HIDDEN_PREFIX)]
    assert bool(hidden_keys) == (joint["model"] == "joint")
    assert joint["rounds"] == 6


def test_a_warm_start_with_no_rounds_evaluates_the_kept_pair(runs, cora) -> None:
    """A warm start from the run that trained the pair starts layer 2 from its block as trained on,
    so that 0 rounds evaluate the run's own model: the same validation score, the same logits."""
    import numpy as np

    from graphstore.runs import read_embeddings

    _, plans = runs
    source = plans[6]
    config = small_config(model=source.config.model, hidden=HIDDEN, layers=3, rounds=0, warm_start=source.run_fp,
                          recipe=source.config.recipe)
    warm = train(cora.store, cora.dataset, cora.partitions["random"], config)
    run_manifests = [json.loads((p.store.run_dir(p.run_fp) / "manifest.json").read_text()) for p in (warm, source)]
    assert run_manifests[0]["val_acc"] == run_manifests[1]["val_acc"]
    for part in range(PARTS):
        logits = [read_embeddings(p.store.embeddings_path(p.run_fp, 3, part))[1]["full"] for p in (warm, source)]
        np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4)


def test_the_fresh_pair_and_gats_pair_are_on_by_default_where_labels_are_scarce(cora, tiny) -> None:
    """Unset, ``joint_fresh`` and GAT's ``joint_rounds`` are decided when the run is planned: where
    fewer than 10 % of the nodes are in the train split (Cora's public split: 140 of 2,708) GAT's
    pair trains the last layer's rounds, and the fresh pair is on wherever the pair trains; off
    where the pair does not train (``joint_rounds`` 0, end to end), where half the nodes train
    (``tiny``: GAT's pair too), and at sites; the run is fingerprinted as with the options given
    explicitly."""

    def planned(graph, partition, **options):
        return plan_run(graph[0], graph[1], partition, TrainConfig(**options), NetworkModel())

    graph = (cora.store, cora.dataset)
    random = cora.partitions["random"]
    for model in ("gcn", "sage", "gat"):
        default = planned(graph, random, model=model)
        assert default.config.joint_fresh is True and default.deeper.config.joint_fresh is True
        assert default.config.trains_jointly and default.deeper.config.trains_jointly
        assert default.run_fp == planned(graph, random, model=model, joint_fresh=True).run_fp
        assert default.run_fp != planned(graph, random, model=model, joint_fresh=False).run_fp
    gat = planned(graph, random, model="gat")
    assert gat.config.joint_rounds == gat.config.layer_rounds(gat.config.layers) == 200
    assert gat.run_fp == planned(graph, random, model="gat", joint_rounds=200, joint_fresh=True).run_fp
    for options in ({"joint_rounds": 0}, {"model": "gat", "joint_rounds": 0}, {"joint_fresh": False}):
        assert planned(graph, random, **options).config.joint_fresh is False
    assert planned(graph, None, strategy="centralized").config.joint_fresh is False
    assert planned(graph, None, strategy="centralized", model="gat").config.joint_rounds is None
    for model in ("gcn", "gat"):
        site = plan_site_run(cora.store, cora.dataset, random, TrainConfig(model=model), NetworkModel(), site=0,
                             sites=4)
        assert site.config.joint_fresh is False
        assert site.config.trains_jointly == (model == "gcn")

    store, dataset, partition = tiny
    assert dataset.manifest.splits["train"] >= 0.1 * dataset.num_nodes
    default = planned((store, dataset), partition)
    assert default.config.joint_fresh is False
    assert default.run_fp == planned((store, dataset), partition, joint_fresh=False).run_fp
    gat = planned((store, dataset), partition, model="gat")
    assert gat.config.joint_rounds is None and not gat.config.trains_jointly and gat.config.joint_fresh is False


def test_a_fresh_pair_trains_after_the_pair_with_its_sync_and_no_more_halo_traffic(cora) -> None:
    """``joint_fresh``: the pair trains as without it (the same metrics, round by round), then the
    pair from the layers' initial parameters as many rounds: as many bytes again in its rounds, the
    same one extra exchange; the kept model is the best on validation of the greedy model and the
    two pairs, and the stored last layer holds the hidden block of the pair kept."""
    import torch

    # a skip connection in the last layer only: the fresh pair's stays zero and frozen
    config = small_config(model="gcn", hidden=HIDDEN, layers=2, rounds=3, lr=0.05, joint_rounds=6,
                          recipe='{"layers": {"2": {"skip": true}}}')
    plans = [train(cora.store, cora.dataset, cora.partitions["random"], config.model_copy(update={"joint_fresh": f}))
             for f in (False, True)]

    def metrics(plan) -> list[dict]:
        return pq.read_table(plan.store.run_dir(plan.run_fp) / "layer=2" / "metrics.parquet").to_pylist()

    def synced(plan, first: int, last: int) -> int:
        comm = pq.read_table(plan.store.run_dir(plan.run_fp) / "comm.parquet").to_pandas()
        rounds = comm[(comm["layer"] == 2) & comm["epoch"].between(first, last) & (comm["kind"] == "grad_sync")]
        return int(rounds["bytes"].sum())

    plain, fresh = (metrics(p) for p in plans)
    assert fresh[:len(plain)] == plain
    assert sorted({r["round"] for r in fresh if r["round"] >= 3}) == list(range(3, 15))
    assert synced(plans[1], 3, 8) == synced(plans[0], 3, 8) == synced(plans[1], 9, 14) > 0
    assert comm_log(plans[1])["halo_aggregates"] == comm_log(plans[0])["halo_aggregates"]
    joint = manifest(plans[1], 2)["recipe"]["joint"]
    best_pair = max(r["acc"] for r in fresh if r["split"] == "val" and 3 <= r["round"] < 9)
    assert joint["best_val"] == max(joint["start_val"], best_pair, joint["fresh_best_val"])
    assert joint["fresh_rounds"] == joint["rounds"] == 6
    state = torch.load(plans[1].store.run_dir(plans[1].run_fp) / "layer=2" / "model.pt", weights_only=True)
    assert any(k.startswith(HIDDEN_PREFIX) for k in state) == (joint["model"] != "greedy")


@pytest.mark.parametrize("hidden_skip", [False, True])
def test_the_fresh_pair_has_the_greedy_pairs_parameters_and_layer_l_minus_1s_recipe(hidden_skip: bool) -> None:
    """The fresh pair's state has the greedy pair's keys and shapes (the kept one loads where the
    greedy one would); its blocks start from the parameters ``new_layer`` draws for them; it drops
    out at layer L-1's rate; layer L's skip connection is zero and frozen where layer L-1 has none."""
    import torch

    from retexo_core.models import Block, LayerWithHead, seeded
    from retexo_core.strategies.joint import Pair, fresh_pair

    def layer(k: int, in_dim: int, out_dim: int, dropout: float, skip: bool) -> LayerWithHead:
        with seeded(7 * 1000 + k):
            return LayerWithHead(Block("gcn", in_dim, out_dim, 1, dropout, last=k == 2, skip=skip), 3)

    hidden, last = layer(1, 5, HIDDEN, 0.2, hidden_skip), layer(2, HIDDEN, 3, 0.5, True)
    initial = {k: v.clone() for k, v in Pair(hidden, last).state_dict().items()}
    for module in (hidden, last):  # as trained: the fresh pair must not start from these
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
    fresh = fresh_pair(hidden, last, seed=7, layer=2, classes=3, device=torch.device("cpu"))
    state = fresh.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in initial.items()}
    assert fresh.hidden.p == fresh.last.block.p == 0.2
    skip = fresh.last.block.skip.weight
    assert skip.requires_grad == hidden_skip and bool(skip.eq(0).all()) != hidden_skip
    for key, value in state.items():
        if key != "last.block.skip.weight" or hidden_skip:
            assert torch.equal(value, initial[key]), key
