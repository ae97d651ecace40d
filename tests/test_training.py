"""Training over partition workers: exact byte accounting, equivalences, inductive hiding, residency."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.runs import read_embeddings
from retexo_core.models import Block, LayerWithHead, build_blocks

from training_helpers import C, F, HIDDEN, K, comm_log, halo_total, params, ring, small_config, train


def test_retexo_logged_bytes_equal_the_analytic_count(tiny) -> None:
    store, dataset, partition = tiny
    rounds = (3, 2)
    plan = train(store, dataset, partition, small_config(rounds=list(rounds)))
    h = halo_total(partition)
    p1 = params(LayerWithHead(Block("gcn", F, HIDDEN, 4, 0.0, last=False), C))
    p2 = params(LayerWithHead(Block("gcn", HIDDEN, C, 4, 0.0, last=True), C))
    # once per launch (one launch trains both layers): counts (8 B to each peer), ids (8 B each),
    # degrees (4 B each), train count
    setup = K * (K - 1) * 8 + 8 * h + 4 * h + ring(8)
    split_stats = ring(8 * 9)  # (loss, correct, count) x (train, val, test), float64
    expected = {
        "control": setup + sum(rounds) * split_stats + ring(8 * 3 * C * C),  # + final confusion matrices
        "halo_features": 4 * F * h,
        "halo_embeddings": 4 * HIDDEN * h,
        "grad_sync": rounds[0] * ring(4 * p1) + rounds[1] * ring(4 * p2),
    }
    assert comm_log(plan) == expected
    manifest = json.loads((plan.store.run_dir(plan.run_fp) / "manifest.json").read_text())
    assert manifest["total_bytes"] == sum(expected.values())


def test_retexo_validates_every_eval_every_rounds_and_at_the_last(tiny) -> None:
    store, dataset, partition = tiny
    rounds, every = (5, 4), 2
    evaluated = sum(1 for r in rounds for k in range(r) if (k + 1) % every == 0 or k == r - 1)  # 3 + 2
    plan = train(store, dataset, partition, small_config(rounds=list(rounds), eval_every=every))
    h = halo_total(partition)
    setup = K * (K - 1) * 8 + 8 * h + 4 * h + ring(8)
    assert comm_log(plan)["control"] == setup + evaluated * ring(8 * 9) + ring(8 * 3 * C * C)
    curves = pq.read_table(store.run_dir(plan.run_fp) / "metrics.parquet").to_pandas()
    assert sorted(set(zip(curves["layer"], curves["round"]))) == [(1, 1), (1, 3), (1, 4), (2, 1), (2, 3)]


def _stopped_rounds(curves: pd.DataFrame, layer: int, patience: int, configured: int) -> int:
    """Rounds an early-stopped layer trains: through the first best validation round + patience."""
    val = curves[(curves["layer"] == layer) & (curves["split"] == "val")].sort_values("round")
    best = int(val["round"].to_numpy()[int(np.argmax(val["acc"].to_numpy()))])  # first best wins
    return min(configured, best + patience + 1)


def test_retexo_early_stopping_trains_through_best_plus_patience_and_logs_those_rounds(tiny) -> None:
    store, dataset, partition = tiny
    rounds, patience = (40, 40), 3
    plan = train(store, dataset, partition, small_config(rounds=list(rounds), patience=patience, lr=0.2))
    curves = pq.read_table(store.run_dir(plan.run_fp) / "metrics.parquet").to_pandas()
    trained = [_stopped_rounds(curves, l, patience, rounds[l - 1]) for l in (1, 2)]
    assert trained[0] < rounds[0]  # it did stop early
    for layer, count in zip((1, 2), trained):
        manifest = json.loads((store.run_dir(plan.run_fp) / f"layer={layer}" / "manifest.json").read_text())
        assert manifest["rounds"] == count
        assert curves[curves["layer"] == layer]["round"].max() == count - 1
    p1 = params(LayerWithHead(Block("gcn", F, HIDDEN, 4, 0.0, last=False), C))
    p2 = params(LayerWithHead(Block("gcn", HIDDEN, C, 4, 0.0, last=True), C))
    assert comm_log(plan)["grad_sync"] == trained[0] * ring(4 * p1) + trained[1] * ring(4 * p2)


def test_standard_early_stopping_logs_only_the_epochs_it_trained(tiny) -> None:
    store, dataset, partition = tiny
    epochs, patience = 60, 3
    plan = train(store, dataset, partition, small_config(strategy="standard", epochs=epochs, patience=patience, lr=0.2))
    curves = pq.read_table(store.run_dir(plan.run_fp) / "metrics.parquet").to_pandas()
    trained = _stopped_rounds(curves, 0, patience, epochs)
    assert trained < epochs
    p = params(build_blocks("gcn", F, HIDDEN, C, 2, 4, 0.0))
    assert comm_log(plan)["grad_sync"] == trained * ring(4 * p)


def test_standard_logged_bytes_equal_the_analytic_count(tiny) -> None:
    store, dataset, partition = tiny
    epochs = 3
    plan = train(store, dataset, partition, small_config(strategy="standard", epochs=epochs))
    h = halo_total(partition)
    p = params(build_blocks("gcn", F, HIDDEN, C, 2, 4, 0.0))
    setup = K * (K - 1) * 8 + 8 * h + 4 * h + ring(8)
    forwards = 2 * epochs + 1  # training + validation forward per epoch, final forward
    expected = {
        "control": setup + epochs * ring(8 * 9) + ring(8 * 3 * C * C),
        "halo_features": 4 * F * h,
        "halo_embeddings": forwards * 4 * HIDDEN * h,
        "halo_grads": epochs * 4 * HIDDEN * h,
        "grad_sync": epochs * ring(4 * p),
    }
    assert comm_log(plan) == expected


def test_retexo_with_one_partition_matches_centralized_layerwise_training(tiny) -> None:
    store, dataset, _ = tiny
    single = build_partition(store, dataset, PartitionOptions(method="random", parts=1))
    config = small_config(rounds=5, dropout=0.3)
    retexo = train(store, dataset, single, config)
    central = train(store, dataset, None, config.model_copy(update={"strategy": "centralized", "layerwise": True}))
    for layer in (1, 2):
        _, h_retexo = read_embeddings(store.embeddings_path(retexo.run_fp, layer, 0))
        _, h_central = read_embeddings(store.embeddings_path(central.run_fp, layer, 0))
        np.testing.assert_array_equal(h_retexo["full"], h_central["full"])
    evaluation = [pq.read_table(store.run_dir(p.run_fp) / "evaluation.parquet").to_pandas() for p in (retexo, central)]
    pd.testing.assert_frame_equal(evaluation[0], evaluation[1])


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_standard_over_partitions_equals_centralized_full_graph_training(tiny, model: str) -> None:
    """Same losses every epoch and same trained weights: the halo exchange forward (activations)
    and backward (gradients) reproduces the centralized computation to 1e-5."""
    store, dataset, partition = tiny
    config = small_config(strategy="standard", model=model, epochs=6, heads=2)
    distributed = train(store, dataset, partition, config)
    central = train(store, dataset, None, config.model_copy(update={"strategy": "centralized"}))
    curves = [pq.read_table(store.run_dir(p.run_fp) / "metrics.parquet").to_pandas() for p in (distributed, central)]
    np.testing.assert_allclose(curves[0]["loss"], curves[1]["loss"], rtol=1e-5, atol=1e-6)
    for layer in (1, 2):
        w = [torch.load(store.layer_dir(p.run_fp, layer) / "model.pt") for p in (distributed, central)]
        for name in w[1]:
            torch.testing.assert_close(w[0][name], w[1][name], rtol=1e-5, atol=1e-5)


def test_gcn_normalisation_equals_pyg_gcn_norm() -> None:
    from torch_geometric.nn import GCNConv

    from retexo_core.halo import in_degree
    from retexo_core.models import local_graph

    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 30, 120), rng.integers(0, 30, 120)
    keys = np.unique(np.concatenate([src * 30 + dst, dst * 30 + src]))
    src, dst = keys // 30, keys % 30
    x = torch.randn(30, 4)
    ours = Block("gcn", 4, 3, 1, 0.0, last=True)
    reference = GCNConv(4, 3)
    reference.load_state_dict(ours.conv.state_dict())
    graph = local_graph("gcn", src, dst, torch.from_numpy(in_degree(30, src, dst)), 30)
    expected = reference(x, torch.from_numpy(np.stack([src, dst])).long())
    torch.testing.assert_close(ours.propagate(x, graph), expected, rtol=1e-5, atol=1e-6)


def test_gat_attention_dropout_acts_only_while_training() -> None:
    """A GAT block with --attention-dropout equals the same block without it in eval mode; while
    training (input dropout off) it draws its masks from the generator: same seed, same output."""
    from retexo_core.halo import in_degree
    from retexo_core.models import local_graph

    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, 30, 150), rng.integers(0, 30, 150)
    graph = local_graph("gat", src, dst, torch.from_numpy(in_degree(30, src, dst)), 30)
    x = torch.randn(30, 8)
    torch.manual_seed(0)
    plain = Block("gat", 8, 8, 2, 0.0, last=False)
    dropping = Block("gat", 8, 8, 2, 0.0, last=False, attention_dropout=0.5)
    dropping.load_state_dict(plain.state_dict())
    plain.eval(), dropping.eval()
    assert torch.equal(dropping(x, graph), plain(x, graph))
    plain.train(), dropping.train()
    first = dropping(x, graph, torch.Generator().manual_seed(5))
    assert torch.equal(first, dropping(x, graph, torch.Generator().manual_seed(5)))
    assert not torch.allclose(first, plain(x, graph, torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_a_last_block_with_a_skip_started_from_the_head_predicts_what_the_head_predicted(model: str) -> None:
    """``start_from_head``: a GCN or GAT block's skip path takes the head, its neighbour path starts
    at zero, so its outputs equal the auxiliary head's logits on the node's own row; a block
    without a skip connection, and SAGE, are left as drawn."""
    from retexo_core.halo import in_degree
    from retexo_core.models import head_state, local_graph, start_from_head

    rng = np.random.default_rng(2)
    src, dst = rng.integers(0, 30, 150), rng.integers(0, 30, 150)
    graph = local_graph(model, src, dst, torch.from_numpy(in_degree(30, src, dst)), 30)
    torch.manual_seed(0)
    hidden = LayerWithHead(Block(model, 6, 8, 2, 0.0, last=False), C)
    h = torch.randn(30, 8)
    if model != "sage":
        last = Block(model, 8, C, 2, 0.0, last=True, skip=True)
        assert start_from_head(last, head_state(hidden))
        last.eval(), hidden.eval()
        torch.testing.assert_close(last(h, graph), hidden.logits(h), rtol=0, atol=1e-6)
    plain = Block(model, 8, C, 2, 0.0, last=True)
    drawn = {k: v.clone() for k, v in plain.state_dict().items()}
    assert not start_from_head(plain, head_state(hidden))
    assert all(torch.equal(v, drawn[k]) for k, v in plain.state_dict().items())


def test_the_last_layer_starts_from_the_head_in_memory_and_from_the_store(tiny) -> None:
    """With a negligible learning rate the last layer (GCN with a skip connection) predicts what
    layer 1's auxiliary head predicts: after layer 1 in the same launch, and in a launch that trains
    it alone (layer 1 linked from the first run: only layer 2's rounds differ), where rank 0 reads
    the head from the store and sends it to each other rank: one control message of C x (HIDDEN + 1)
    float32 values."""
    store, dataset, partition = tiny
    runs = [train(store, dataset, partition, small_config(skip=True, rounds=[4, r], lr=[0.05, 1e-9])) for r in (2, 3)]
    second = json.loads((store.run_dir(runs[1].run_fp) / "manifest.json").read_text())
    assert second["layers"][0]["reused_from"] == f"runs/run={runs[0].run_fp}/layer=1"
    head_bytes = C * (HIDDEN + 1) * 4  # not a multiple of 8: no other control message has this size
    for plan, expected in zip(runs, ([], [(0, dst, 2) for dst in range(1, K)])):
        logged = pq.read_table(store.run_dir(plan.run_fp) / "comm.parquet").to_pandas()
        heads = logged[(logged["kind"] == "control") & (logged["bytes"] == head_bytes)]
        assert list(zip(heads["src"], heads["dst"], heads["layer"])) == expected
    state = torch.load(store.layer_dir(runs[0].run_fp, 1) / "model.pt", weights_only=True)
    for part in range(K):
        ids, views = read_embeddings(store.embeddings_path(runs[0].run_fp, 1, part))
        probabilities = torch.softmax(torch.from_numpy(views["full"]) @ state["head.weight"].t() + state["head.bias"], 1)
        for plan in runs:
            predicted = pq.read_table(store.layer_dir(plan.run_fp, 2) / f"part={part}" / "predictions.parquet").to_pandas()
            assert np.array_equal(predicted["node_id"].to_numpy(), ids)
            assert np.array_equal(predicted["predicted"].to_numpy(), probabilities.argmax(1).numpy())
            np.testing.assert_allclose(predicted["score"].to_numpy(), probabilities.max(1).values.numpy(), atol=1e-5)


def test_weight_decay_reaches_only_the_first_block_by_default() -> None:
    """Kipf & Welling's recipe: with zero loss gradients, one Adam step moves the first block's
    parameters (weight decay) and leaves the others exactly where they were."""
    from retexo_core.config import TrainConfig
    from retexo_core.strategies.endtoend import new_optimizer

    blocks = build_blocks("gcn", F, HIDDEN, C, 3, 4, 0.0)
    before = {name: p.detach().clone() for name, p in blocks.named_parameters()}
    optimizer = new_optimizer(TrainConfig(layers=3), blocks)
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in blocks.named_parameters():
        moved = not torch.equal(p.detach(), before[name])
        assert moved == (name.startswith("0.") and bool(before[name].abs().sum() > 0)), name


def test_default_learning_rate_is_lower_only_for_layer_one_of_layerwise_gcn() -> None:
    """Unset ``lr`` resolves per layer (layer-wise GCN: 0.005 for layer 1, else 0.01), and the
    fingerprint payloads equal those of the same rates spelled out, so either spelling reuses the
    other's results."""
    from retexo_core.config import TrainConfig

    def rates(**options: object) -> list[float]:
        config = TrainConfig(layers=3, **options)
        return [config.layer_lr(layer) for layer in (1, 2, 3)]

    assert rates() == rates(strategy="centralized", layerwise=True) == [0.005, 0.01, 0.01]
    for options in ({"model": "sage"}, {"model": "gat"}, {"strategy": "centralized"}, {"strategy": "standard"}):
        assert rates(**options) == [0.01, 0.01, 0.01], options
    assert rates(lr=0.02) == [0.02] * 3
    default, spelled = TrainConfig(), TrainConfig(lr=[0.005, 0.01])
    assert default.run_payload() == spelled.run_payload()
    assert default.layer_payload(1) == spelled.layer_payload(1) != TrainConfig(lr=0.01).layer_payload(1)
    assert TrainConfig(strategy="standard").run_payload() == TrainConfig(strategy="standard", lr=0.01).run_payload()
    assert TrainConfig(rounds=20).run_payload()["rounds"] == 20  # options as given (manifests, SQL)


@pytest.mark.parametrize("strategy", ["retexo", "standard"])
def test_warm_start_with_zero_rounds_reproduces_the_model_and_sends_only_its_exchanges(tiny, strategy: str) -> None:
    store, dataset, partition = tiny
    trained = train(store, dataset, partition, small_config(strategy=strategy, rounds=4, epochs=4))
    again = train(store, dataset, partition,
                  small_config(strategy=strategy, rounds=0, epochs=0, warm_start=trained.run_fp[:6]))
    assert again.config.warm_start == trained.run_fp and again.run_fp != trained.run_fp
    first, second = (json.loads((p.store.run_dir(p.run_fp) / "manifest.json").read_text()) for p in (trained, again))
    assert first["evaluation"] == second["evaluation"]
    chained = train(store, dataset, partition,  # an evaluation run is itself a valid warm start
                    small_config(strategy=strategy, rounds=0, epochs=0, warm_start=again.run_fp))
    assert json.loads((chained.store.run_dir(chained.run_fp) / "manifest.json").read_text())["evaluation"] == first["evaluation"]
    h = halo_total(partition)
    exchanges = {"halo_features": 4 * F * h, "halo_embeddings": 4 * HIDDEN * h}  # one forward pass, no training
    assert {k: v for k, v in comm_log(again).items() if k != "control"} == exchanges
    predictions = [pd.concat([pq.read_table(p).to_pandas() for p in sorted(plan.layer_dir(2).glob("part=*/predictions.parquet"))])
                   for plan in (trained, again)]
    for rows in predictions:
        assert len(rows) == dataset.num_nodes and rows["node_id"].is_unique
        assert rows["score"].between(1 / C, 1).all() and set(rows["split"]) <= {"train", "val", "test", "none"}
    assert predictions[0]["predicted"].tolist() == predictions[1]["predicted"].tolist()


def test_predictions_are_the_argmax_of_the_last_layer_outputs(tiny) -> None:
    store, dataset, partition = tiny
    plan = train(store, dataset, partition, small_config())
    for part in range(K):
        node_id, views = read_embeddings(plan.layer_dir(2) / f"part={part}" / "embeddings.parquet")
        rows = pq.read_table(plan.layer_dir(2) / f"part={part}" / "predictions.parquet").to_pandas()
        assert rows["node_id"].tolist() == node_id.tolist()
        assert rows["predicted"].tolist() == views["full"].argmax(1).tolist()
        expected = torch.softmax(torch.from_numpy(views["full"]), 1).max(1).values.numpy()
        np.testing.assert_allclose(rows["score"], expected, rtol=1e-5)


def test_warm_start_refuses_a_run_that_does_not_fit_and_zero_rounds_without_it(tiny) -> None:
    from graphstore.errors import StoreError
    from pydantic import ValidationError

    store, dataset, partition = tiny
    trained = train(store, dataset, partition, small_config())
    with pytest.raises(StoreError, match="hidden 8, this run 16"):
        train(store, dataset, partition, small_config(hidden=16, warm_start=trained.run_fp))
    with pytest.raises(StoreError, match="no unique completed run 'ffffff'"):
        train(store, dataset, partition, small_config(warm_start="ffffff"))
    with pytest.raises(ValidationError, match="needs warm_start"):
        small_config(rounds=0)


@pytest.mark.parametrize("strategy", ["retexo", "standard"])
def test_skipping_zero_gradient_entries_changes_only_the_bytes(tiny, strategy: str) -> None:
    store, dataset, partition = tiny
    rounds = (3, 2)
    config = small_config(strategy=strategy, rounds=list(rounds), dropout=0.3)
    dense, packed = (train(store, dataset, partition, config.model_copy(update={"skip_zero_grads": skip}))
                     for skip in (False, True))
    for layer in ((1, 2) if strategy == "retexo" else (2,)):
        for part in range(K):
            ids, ours = read_embeddings(store.embeddings_path(packed.run_fp, layer, part))
            theirs_ids, theirs = read_embeddings(store.embeddings_path(dense.run_fp, layer, part))
            assert np.array_equal(ids, theirs_ids)
            np.testing.assert_array_equal(ours["full"], theirs["full"])
    evaluation = [pq.read_table(store.run_dir(p.run_fp) / "evaluation.parquet").to_pandas() for p in (packed, dense)]
    pd.testing.assert_frame_equal(evaluation[0], evaluation[1])
    ours, theirs = comm_log(packed), comm_log(dense)
    syncs = sum(rounds) if strategy == "retexo" else config.epochs
    # every gradient all-reduce sends its two steps' payload lengths first: 8 B to each peer, twice
    assert ours["control"] == theirs["control"] + syncs * 2 * K * (K - 1) * 8
    assert ours["grad_sync"] <= theirs["grad_sync"]
    assert {k: v for k, v in ours.items() if k not in ("control", "grad_sync")} == \
        {k: v for k, v in theirs.items() if k not in ("control", "grad_sync")}
