"""Mini-batches within a layer: one batch holding every train node is full-batch training exactly,
and mini-batch runs log exactly the analytic bytes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from graphstore.runs import read_embeddings
from retexo_core.models import Block, LayerWithHead
from training_helpers import C, F, HIDDEN, K, comm_log, halo_total, params, ring, small_config, train


def local_train_counts(partition) -> list[int]:
    return [int((pq.read_table(partition.path / f"part={i}" / "nodes.parquet").column("split").to_numpy(
        zero_copy_only=False) == "train").sum()) for i in range(K)]


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_one_batch_holding_every_train_node_is_full_batch_training(tiny, model: str) -> None:
    store, dataset, partition = tiny
    config = small_config(model=model, heads=2, rounds=4, dropout=0.3)
    full = train(store, dataset, partition, config)
    batched = train(store, dataset, partition, config.model_copy(update={"batch_size": 1000}))
    for layer in (1, 2):
        for part in range(K):
            _, a = read_embeddings(store.embeddings_path(full.run_fp, layer, part))
            _, b = read_embeddings(store.embeddings_path(batched.run_fp, layer, part))
            np.testing.assert_array_equal(a["full"], b["full"])
        wa, wb = (torch.load(store.layer_dir(p.run_fp, layer) / "model.pt") for p in (full, batched))
        assert all(torch.equal(wa[name], wb[name]) for name in wa)


@pytest.mark.parametrize("sync", ["grad", "avg"])
def test_mini_batch_runs_log_exactly_the_analytic_bytes(tiny, sync: str) -> None:
    store, dataset, partition = tiny
    rounds, batch = (3, 2), 4
    plan = train(store, dataset, partition, small_config(rounds=list(rounds), batch_size=batch, sync=sync,
                                                         sync_every=2))
    counts = local_train_counts(partition)
    steps = max(-(-c // batch) for c in counts)
    assert steps > 1  # the batches really split the train nodes
    h = halo_total(partition)
    p1 = params(LayerWithHead(Block("gcn", F, HIDDEN, 4, 0.0, last=False), C))
    p2 = params(LayerWithHead(Block("gcn", HIDDEN, C, 4, 0.0, last=True), C))
    setup = K * (K - 1) * 8 + 8 * h + 4 * h + ring(8)
    if sync == "grad":  # every step all-reduces the gradients; the train counts are agreed per layer
        synced = {"grad_sync": steps * (rounds[0] * ring(4 * p1) + rounds[1] * ring(4 * p2))}
        agreement, evaluated = 2 * K * (K - 1) * 8, sum(rounds)
    else:  # local steps; parameters averaged every 2 rounds and at the last round
        averaged = [sum(1 for k in range(r) if (k + 1) % 2 == 0 or k == r - 1) for r in rounds]
        synced = {"model_sync": averaged[0] * ring(4 * p1) + averaged[1] * ring(4 * p2)}
        # the drift-correction test: all-reduces of the class counts (and whether a rank trains), then of chi-square
        agreement, evaluated = ring(8 * (C + 1)) + ring(8), sum(averaged)
    expected = {
        "control": setup + agreement + evaluated * ring(8 * 9) + ring(8 * 3 * C * C),
        "halo_features": 4 * F * h,
        "halo_embeddings": 4 * HIDDEN * h,
        **synced,
    }
    assert comm_log(plan) == expected


def test_gat_mini_batches_propagate_over_their_targets_in_edges(tiny) -> None:
    """GAT's attention is recomputed per batch over the batch's 1-hop in-edges; a run of several
    steps per round trains and evaluates every node."""
    store, dataset, partition = tiny
    plan = train(store, dataset, partition, small_config(model="gat", heads=2, rounds=3, batch_size=3))
    evaluation = pq.read_table(store.run_dir(plan.run_fp) / "evaluation.parquet").to_pandas().set_index("split")
    assert evaluation.loc["test", "nodes"] > 0 and 0.0 <= evaluation.loc["test", "accuracy"] <= 1.0
    assert comm_log(plan)["grad_sync"] > 0
