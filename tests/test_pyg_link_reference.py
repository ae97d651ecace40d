"""The plain PyG link-prediction reference (``benchmarks/pyg_link_reference.py``) learns the links
of a small stochastic block model, returns metrics in [0, 1], and is repeatable: two runs with
the same seed give the same metrics.

Four blocks, not two: with two equal blocks half the negative pairs fall inside a block, so a
scorer that knows only the blocks cannot pass a ROC-AUC of about 0.73; with four (and these edge
probabilities) about 0.84.

The test runs torch on one thread: on a 200-node graph more threads only add overhead, and on a
busy machine with few cores their spin-waits made each scatter ~500x slower (50 s instead of
a few)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from processes import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from pyg_link_reference import train_plain_link  # noqa: E402

NODES, BLOCKS, P_IN, P_OUT, NOISE = 200, 4, 0.2, 0.005, 0.3


def sbm_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Features (N, BLOCKS) = noisy block indicators, the training graph (2, E) with both directions,
    and val / test pairs (10 % of the edges each, as many non-edges as negatives)."""
    rng = np.random.default_rng(seed)
    block = np.arange(NODES) % BLOCKS
    x = (np.eye(BLOCKS)[block] + rng.normal(0, NOISE, (NODES, BLOCKS))).astype(np.float32)
    src, dst = np.triu_indices(NODES, k=1)
    prob = np.where(block[src] == block[dst], P_IN, P_OUT)
    linked = rng.random(len(src)) < prob
    edges = np.stack([src[linked], dst[linked]])[:, rng.permutation(int(linked.sum()))]
    non_edges = np.stack([src[~linked], dst[~linked]])[:, rng.permutation(int((~linked).sum()))]
    n_eval = edges.shape[1] // 10
    pairs = {}
    for k, split in enumerate(("val", "test")):
        pos = edges[:, k * n_eval:(k + 1) * n_eval]
        neg = non_edges[:, k * n_eval:(k + 1) * n_eval]
        label = np.r_[np.ones(n_eval, np.int64), np.zeros(n_eval, np.int64)]
        pairs[split] = (np.r_[pos[0], neg[0]], np.r_[pos[1], neg[1]], label)
    train = edges[:, 2 * n_eval:]
    return x, np.hstack([train, train[::-1]]).astype(np.int64), pairs


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_plain_link_reference_learns_and_repeats(one_thread: None) -> None:
    x, train_edges, pairs = sbm_split()
    first = train_plain_link(x, train_edges, pairs, seed=0, epochs=30, hits_k=10)
    second = train_plain_link(x, train_edges, pairs, seed=0, epochs=30, hits_k=10)
    assert 1 <= first.best_epoch <= 30 and first.seconds > 0
    assert set(first.metrics) == {"val", "test"}
    for split, metrics in first.metrics.items():
        assert set(metrics) == {"roc_auc", "mrr", "hits_at_k"}
        assert all(0.0 <= value <= 1.0 for value in metrics.values()), (split, metrics)
        assert metrics["roc_auc"] > 0.7, (split, metrics)
    assert first.metrics == second.metrics and first.best_epoch == second.best_epoch
