"""The probe of ``benchmarks/joint_last_layers.py``: ranks that hold their owned rows and their
halo's rows of layer L−1's inputs and aggregated inputs compute the last two layers exactly. With
dropout off, the ranks' outputs equal the whole graph's, the sum of the ranks' gradients (the
all-reduce) equals the whole graph's gradient, and the extra exchange's bytes are every rank's
halo rows, counted from the edge list."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from processes import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from joint_last_layers import Block, rank_inputs, with_adjacency  # noqa: E402


def test_ranks_compute_the_last_two_layers_of_the_whole_graph() -> None:
    gen = torch.Generator().manual_seed(0)
    n, d, classes, parts_count = 60, 5, 3, 4
    edges = torch.randint(0, n, (2, 180), generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    train = torch.rand(n, generator=gen) < 0.5
    graph = with_adjacency(torch.rand(n, d, generator=gen), y, edges, masks=[], auc=False, skip=True, norm=True,
                           dropout=0.0)
    parts = torch.randint(0, parts_count, (n,), generator=gen)
    everyone = torch.arange(n)
    adj = graph.adjacency(everyone, everyone)
    torch.manual_seed(0)
    hidden, last = Block(graph, d, 8, last=False), Block(graph, 8, classes, last=True)
    params = list(hidden.parameters()) + list(last.parameters())

    z = graph.x
    h = hidden(adj @ z, z, True)
    whole = last(adj @ h, h, True)
    F.cross_entropy(whole[train], y[train], reduction="sum").backward()
    expected = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for p in params:
        p.grad = None

    ranks, extra = rank_inputs(graph, z, adj @ z, parts)
    at_ranks = torch.zeros(n, classes)
    for owned, local, aggregated, own in ranks:
        h = hidden(aggregated, own, True)
        out = last(local @ h, h[: len(owned)], True)
        at_ranks[owned] = out.detach()
        mine = train[owned]
        F.cross_entropy(out[mine], y[owned][mine], reduction="sum").backward()

    assert torch.allclose(at_ranks, whole.detach(), atol=1e-5)
    for p, g in zip(params, expected):
        assert torch.allclose(p.grad, g, atol=1e-5)  # type: ignore[arg-type]
    pairs = {(int(s), int(t)) for s, t in torch.cat([edges, edges.flip(0)], 1).t()}
    halo_rows = sum(len({s for s, t in pairs if parts[t] == r and parts[s] != r}) for r in range(parts_count))
    assert extra == halo_rows * d * 4
