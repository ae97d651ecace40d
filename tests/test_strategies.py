"""VARCO, TMA and Grappa: exact byte counts, equivalences with centralized training, the VARCO
schedule, Grappa's estimator and TMA's fault tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, cli_env, run_cli
from graphstore.layout import Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from retexo_core.models import build_blocks
from retexo_core.strategies.endtoend import varco_ratio
from retexo_core.strategies.isolated import coverage_weights
from training_helpers import C, F, HIDDEN, K, comm_log, halo_total, ingest_sbm, params, ring, run_and_kill_a_worker, small_config, train

P = params(build_blocks("gcn", F, HIDDEN, C, 2, 4, 0.0))


def final_evaluation_bytes(h: int) -> dict[str, int]:
    """Isolated strategies: setup protocol, features and one full-graph forward, confusion matrices."""
    return {"control": K * (K - 1) * 8 + 12 * h + ring(8) + ring(8 * 3 * C * C),
            "halo_features": 4 * F * h, "halo_embeddings": 4 * HIDDEN * h}


def test_varco_ratio_moves_from_c_max_to_c_min() -> None:
    ratios = [varco_ratio(e, 11, 8.0, 2.0, "linear") for e in range(11)]
    assert ratios[0] == 8.0 and ratios[-1] == 2.0
    assert all(a > b for a, b in zip(ratios, ratios[1:]))
    assert {varco_ratio(e, 11, 8.0, 2.0, "fixed") for e in range(11)} == {8.0}


def test_grappa_estimator_without_missing_edges_is_plain_averaging() -> None:
    degree = np.array([3.0, 0.0, 5.0, 1.0])
    for shrinkage in (0.0, 0.3, 1.0):
        np.testing.assert_array_equal(coverage_weights(degree, degree, shrinkage), np.ones(4))
    # with missing edges the poorly covered node counts less; shrinkage pulls towards uniform
    weights = coverage_weights(np.array([1.0, 4.0]), np.array([4.0, 4.0]), 0.0)
    np.testing.assert_allclose(weights, [0.25, 1.0])
    np.testing.assert_allclose(coverage_weights(np.array([1.0]), np.array([4.0]), 0.5), [0.625])


def _grappa_gradient(partition_dir: str, shrinkage: float):
    """The gradient Grappa's workers sum (their real objective and all-reduce), on K thread ranks."""
    from pathlib import Path as _Path

    from retexo_core.data import load_part
    from retexo_core.strategies.common import sync_gradients
    from retexo_core.strategies.endtoend import new_model
    from retexo_core.strategies.isolated import grappa_loss, grappa_weights_and_total, isolated_context

    def rank(comm):
        config = small_config(strategy="grappa", grappa_shrinkage=shrinkage)
        ctx = isolated_context(comm, load_part(_Path(partition_dir), comm.rank), config)
        blocks = new_model(ctx)
        weights, total = grappa_weights_and_total(ctx)
        grappa_loss(ctx, blocks, weights, total).backward()
        sync_gradients(comm, blocks)
        return {name: p.grad.clone() for name, p in blocks.named_parameters()}, blocks.state_dict()

    from dist_helpers import run_threads

    return [result for result, _rows in run_threads(rank, K)]


@pytest.mark.parametrize("shrinkage", [0.0, 0.5])
def test_grappa_workers_sum_the_coverage_corrected_gradient(tiny, shrinkage: float) -> None:
    """The estimator g = sum_p sum_{v in T_p} w_v grad l_v(G_p) / sum w, computed independently with
    PyG's GCN on each partition's own subgraph, equals what Grappa's workers sum."""
    from torch_geometric.nn import GCNConv

    store, dataset, partition = tiny
    results = _grappa_gradient(str(partition.path), shrinkage)
    grads, state = results[0][0], results[0][1]
    for other, _ in results[1:]:
        for name in grads:
            torch.testing.assert_close(other[name], grads[name])  # every rank holds the same sum
    nodes = pd.read_parquet(dataset.path / "nodes.parquet")
    x = torch.from_numpy(np.stack(pd.read_parquet(dataset.path / "features.parquet")["x"].to_numpy())).float()
    edges = pd.read_parquet(dataset.path / "edges.parquet")
    part = pd.read_parquet(partition.path / "assignment.parquet").set_index("node_id")["part"].loc[nodes["node_id"]].to_numpy()
    src, dst = edges["src"].to_numpy(), edges["dst"].to_numpy()  # ids are 0..N-1
    inside = part[src] == part[dst]
    coverage = np.bincount(dst[inside], minlength=len(nodes)) / np.maximum(np.bincount(dst, minlength=len(nodes)), 1)
    coverage[np.bincount(dst, minlength=len(nodes)) == 0] = 1.0
    weight = torch.from_numpy((1 - shrinkage) * coverage + shrinkage).float()
    convs = [GCNConv(F, HIDDEN), GCNConv(HIDDEN, C)]
    convs[0].load_state_dict({"bias": state["0.conv.bias"], "lin.weight": state["0.conv.lin.weight"]})
    convs[1].load_state_dict({"bias": state["1.conv.bias"], "lin.weight": state["1.conv.lin.weight"]})
    train = torch.from_numpy(nodes["split"].to_numpy() == "train")
    y = torch.from_numpy(nodes["label"].to_numpy().copy())
    loss = 0.0
    for p in range(K):
        keep = inside & (part[dst] == p)
        edge_index = torch.from_numpy(np.stack([src[keep], dst[keep]]))
        logits = convs[1](torch.relu(convs[0](x, edge_index)), edge_index)
        mine = train & torch.from_numpy(part == p)
        loss = loss + (torch.nn.functional.cross_entropy(logits[mine], y[mine], reduction="none") * weight[mine]).sum()
    (loss / weight[train].sum()).backward()
    reference = {"0.conv.lin.weight": convs[0].lin.weight.grad, "0.conv.bias": convs[0].bias.grad,
                 "1.conv.lin.weight": convs[1].lin.weight.grad,
                 "1.conv.bias": convs[1].bias.grad}
    for name, expected in reference.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6, msg=name)


def test_tma_logged_bytes_equal_the_analytic_count(tiny) -> None:
    store, dataset, partition = tiny
    epochs, every = 5, 2
    plan = train(store, dataset, partition, small_config(strategy="tma", epochs=epochs, agg_every_steps=every))
    aggregations = sum(1 for e in range(epochs) if (e + 1) % every == 0 or e == epochs - 1)
    expected = final_evaluation_bytes(halo_total(partition))
    expected["control"] += aggregations * ring(8 * 9)
    expected["model_sync"] = aggregations * ring(4 * (P + 1))
    assert comm_log(plan) == expected


def test_grappa_logged_bytes_equal_the_analytic_count(tiny) -> None:
    store, dataset, partition = tiny
    epochs, refresh = 5, 2
    plan = train(store, dataset, partition, small_config(strategy="grappa", epochs=epochs, grappa_refresh_every=refresh))
    periods = -(-epochs // refresh)
    expected = final_evaluation_bytes(halo_total(partition))
    expected["control"] += periods * ring(8) + epochs * ring(8 * 9)
    expected["grad_sync"] = epochs * ring(4 * P)
    assert comm_log(plan) == expected
    refreshes = [json.loads(p.read_text()) for p in partition.path.parent.glob("fp=*/manifest.json")]
    assert {r["seed"] for r in refreshes if r["method"] == "random" and r["parts"] == K} >= {0, 1, 2}


@pytest.fixture(scope="module")
def sbm(tmp_path_factory: pytest.TempPathFactory):
    """``ingest_sbm`` in K random parts."""
    store = Store.open(tmp_path_factory.mktemp("sbm-store"))
    dataset = ingest_sbm(store)
    return store, dataset, build_partition(store, dataset, PartitionOptions(method="random", parts=K, seed=0))


@pytest.mark.parametrize("strategy", ["tma", "grappa"])
def test_isolated_strategies_judge_recipe_candidates_on_the_full_graph(sbm, strategy) -> None:
    """TMA and Grappa validate on their local graphs while they train, a figure that can rank two
    recipes the other way round from the full graph's. The search judges each candidate by its
    validation on the full graph (for Grappa over the same partition whatever period its best
    epoch fell in): the first candidate scores what a run without a search evaluates, and the
    kept one is the best tried and the run's validation."""
    store, dataset, partition = sbm
    extra = {"grappa_refresh_every": 2} if strategy == "grappa" else {"agg_every_steps": 2}

    def run(recipe: str) -> tuple[dict, float]:
        plan = train(store, dataset, partition, small_config(strategy=strategy, epochs=4, recipe=recipe, **extra))
        evaluation = pq.read_table(store.run_dir(plan.run_fp) / "evaluation.parquet").to_pandas()
        layer = json.loads((store.layer_dir(plan.run_fp, 1) / "manifest.json").read_text())
        return layer, float(evaluation.loc[evaluation.split == "val", "accuracy"].iloc[0])

    layer, val = run("auto")
    recipe, tried = layer["recipe"], layer["recipe"]["val_scores"]
    assert len(tried) > 2 and all("gained" in t for t in tried[1:])  # paired over the same nodes
    assert recipe == {**recipe, **{k: v for k, v in max(tried, key=lambda t: t["val"]).items() if k in recipe}}
    assert max(t["val"] for t in tried) == pytest.approx(val, abs=1e-12)
    start, start_val = run("default")
    assert tried[0]["val"] == pytest.approx(start_val, abs=1e-12) and start["best_val"] != start_val


def pair_counts(partition) -> dict[tuple[int, int], int]:
    """(owner, requester) -> number of the requester's halo nodes that owner holds."""
    counts = {}
    for j in range(K):
        owners = pq.read_table(partition.path / f"part={j}" / "halo.parquet").column("owner").to_numpy()
        for i in range(K):
            counts[(i, j)] = int((owners == i).sum())
    return counts


def test_varco_logged_bytes_equal_the_analytic_count(tiny) -> None:
    store, dataset, partition = tiny
    epochs = 4
    config = small_config(strategy="varco", epochs=epochs, varco_c_max=4.0, varco_c_min=1.0)
    plan = train(store, dataset, partition, config)
    h = halo_total(partition)
    counts = pair_counts(partition)
    sampled = [sum(int(1.0 / varco_ratio(e, epochs, 4.0, 1.0, "linear") * m) for (i, j), m in counts.items() if i != j)
               for e in range(epochs)]
    setup = K * (K - 1) * 8 + 12 * h + ring(8)
    expected = {
        "control": setup + 8 * sum(sampled) + epochs * ring(8 * 9) + ring(8 * 3 * C * C),
        "halo_features": 4 * F * h,  # raw features once, cached, as standard does
        # training forwards: the sampled rows; validation and final forwards: every row
        "halo_embeddings": 4 * HIDDEN * sum(sampled) + (epochs + 1) * 4 * HIDDEN * h,
        "halo_grads": 4 * HIDDEN * sum(sampled),  # gradients of the sampled rows only
        "grad_sync": epochs * ring(4 * P),
    }
    assert comm_log(plan) == expected
    standard = train(store, dataset, partition, config.model_copy(update={"strategy": "standard"}))
    assert sum(expected.values()) < sum(comm_log(standard).values())


@pytest.mark.parametrize("strategy", ["tma", "grappa"])
def test_isolated_strategies_with_one_partition_equal_centralized_training(tiny, strategy: str) -> None:
    store, dataset, _ = tiny
    single = build_partition(store, dataset, PartitionOptions(method="random", parts=1))
    config = small_config(strategy=strategy, epochs=6, dropout=0.3, agg_every_steps=1, grappa_refresh_every=100)
    isolated = train(store, dataset, single, config)
    central = train(store, dataset, None, small_config(strategy="centralized", epochs=6, dropout=0.3))
    curves = [pq.read_table(store.run_dir(p.run_fp) / "metrics.parquet").to_pandas() for p in (isolated, central)]
    pd.testing.assert_frame_equal(curves[0], curves[1])
    for layer in (1, 2):
        w = [torch.load(store.layer_dir(p.run_fp, layer) / "model.pt") for p in (isolated, central)]
        for name in w[1]:
            assert torch.equal(w[0][name], w[1][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("tolerate", [True, False])
def test_a_killed_tma_trainer_is_dropped_with_the_flag_and_fails_the_run_without(tmp_path: Path, tolerate: bool) -> None:
    store = tmp_path / "store"
    run_cli("ingest", "planetoid", REPO / "data" / "cora", "--name", "cora", store=store).check_returncode()
    # --recipe default: the search would train each of its candidates for the 1500 epochs (10,500 in
    # all), which took this test past 300 s on a loaded CI machine; the search is tested on its own.
    # Even so it took 151 s in all here under the whole suite's load, hence the 600 s bound after the kill.
    cmd = [sys.executable, "-m", "cli", "train", "cora", "--strategy", "tma", "--parts", "3", "--epochs", "1500",
           "--agg-every-steps", "5", "--hidden", "16", "--timeout", "60", "--recipe", "default", "--store", str(store)]
    cmd += ["--tolerate-failures"] if tolerate else []
    code, _, err, _ = run_and_kill_a_worker(cmd, cli_env(), store, workers=3, victim=1, timeout_s=600)
    if not tolerate:
        assert code == 2 and "worker rank 1 was killed by signal 9" in " ".join(err.split())
        return
    assert code == 0, err
    manifest = json.loads(next(store.glob("runs/run=*/layer=2/manifest.json")).read_text())
    assert manifest["dropped_parts"] == [1]
    comm = pd.concat(pd.read_parquet(p) for p in store.glob("runs/run=*/comm.parquet"))
    # every rank logs what it sends; the killed rank's own rows die with it, the survivors' remain
    assert set(comm["src"]) == {0, 2}
    evaluation = pd.read_parquet(next(store.glob("runs/run=*/evaluation.parquet")))
    assert evaluation.set_index("split").loc["test", "nodes"] < 1000  # only the survivors' nodes
