"""Aggregate once per layer: the frozen aggregates give the per-round conv's outputs, sparse features
give the dense features' outputs, and sparse halo rows arrive exactly with their bytes logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from dist_helpers import run_threads
from retexo_core.comm.sparse_codec import encoded_rows_nbytes
from retexo_core.data import load_part
from retexo_core.models import seeded
from retexo_core.sparse import SparseMatrix
from retexo_core.strategies.common import make_context
from retexo_core.strategies.retexo import LayerInputs, gather_inputs, new_layer
from training_helpers import K, small_config

VIEWS = ("train", "val", "full")


def _layer_outputs(partition_dir: str, model: str, setting: str, sparse: bool):
    """Per rank: layer-1 outputs per view from the streamed aggregates, from the per-round propagation
    over the gathered inputs, from PyG's conv on the same local graph; the halo rows received and
    the log rows of the streamed exchange."""

    def rank(comm):
        data = load_part(Path(partition_dir), comm.rank)
        if sparse:
            data.x = SparseMatrix.from_dense(data.x)
        config = small_config(model=model, setting=setting)
        ctx = make_context(comm, data, config)
        own = dict.fromkeys(VIEWS, data.x)
        start = len(comm.log.rows)
        module = new_layer(ctx, 1, data.x.shape[1])
        module.eval()
        (prepared,) = LayerInputs.exchanged(ctx, 1, model, own, [lambda x: x])  # streamed aggregates (the run's path)
        prepared.block = module.block
        exchanged = comm.log.rows[start:]
        inputs = gather_inputs(ctx, 1, own)  # the whole halo at once, for the per-round reference
        out = {}
        with torch.no_grad():
            for view in VIEWS:
                x_local = inputs[view].to_dense() if sparse else inputs[view]
                graph = ctx.graphs[view]
                rows, cols = graph.adj.row_index(), graph.adj.col
                reference = module.block.finish(
                    _pyg(module.block.conv, model, x_local, cols, rows, graph.adj.val, graph.num_owned))
                out[view] = (prepared.outputs(view), module.block(inputs[view], graph), reference)
        halo = inputs["full"].to_dense()[data.num_owned:] if sparse else inputs["full"][data.num_owned:]
        return out, halo, exchanged, data

    return [result for result, _ in run_threads(rank, K)]


def _pyg(conv, model: str, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, weight: torch.Tensor,
         n: int) -> torch.Tensor:
    """PyG's own conv on the local graph (rows [0, n) exact)."""
    with seeded(0):  # ranks are threads: build modules under the lock that keeps initialisation seeded
        if model == "gcn":
            reference = GCNConv(conv.in_channels, conv.out_channels, normalize=False)
        elif model == "sage":
            reference = SAGEConv(conv.in_channels, conv.out_channels, aggr="mean")
        else:
            reference = GATConv(conv.in_channels, conv.out_channels, heads=conv.heads, concat=conv.concat)
    reference.load_state_dict(conv.state_dict())
    reference.to(x.dtype)
    if model == "gcn":
        return reference(x, torch.stack([src, dst]), weight.to(x.dtype))[:n]
    return reference(x, torch.stack([src, dst]))[:n]


U32 = 2.0 ** -24  # float32's unit roundoff: one rounding moves a value by at most this fraction of it


def float32_error_bound(conv, model: str, x: torch.Tensor, graph) -> torch.Tensor:
    """(n, out) bound on |the conv computed in float32 - the exact conv| of each output, to first
    order in ``U32``, from the magnitudes of the terms that each output sums.

    A sum of k terms (a dot product, a row of a sparse product) computed in float32, in any order,
    is off by at most k * U32 * (the same sum over absolute values) (Higham, Accuracy and Stability
    of Numerical Algorithms, 3.1); ``mag`` below is that sum of absolute values through the layer.
    Two float32 implementations of one conv differ only in the order of their sums (and a torch
    kernel's order depends on how many threads share it), so each lies within this bound of the
    exact result, never necessarily within a fixed 1e-5 of the other.

    GCN / SAGE: F products per feature transform, at most ``deg`` per aggregation, 2 additions
    (bias, own row). GAT (heads concatenated): ``h = x W`` (F products); the logits ``e = a_src[j]
    + a_dst[i]`` (C products each) are off by (F + C + 2) U32 L, L the magnitude of their terms;
    the softmax's exp turns an absolute logit error into a relative error of ``alpha`` (twice:
    numerator and the row's sum) and adds deg + 2 roundings; the weighted sum adds deg more.
    """
    f, n = x.shape[1], graph.num_owned
    rows, cols = graph.adj.row_index(), graph.adj.col
    deg = torch.bincount(rows, minlength=n).double().unsqueeze(1)  # (n, 1) stored in-edges per row
    ax = x.double().abs()
    if model in ("gcn", "sage"):
        weight = graph.adj.val.double().abs().unsqueeze(1)
        lin = conv.lin if model == "gcn" else conv.lin_l
        aggregated = torch.zeros(n, f, dtype=torch.float64).index_add(0, rows, weight * ax[cols])
        mag = aggregated @ lin.weight.double().abs().t()
        bias = conv.bias if model == "gcn" else conv.lin_l.bias
        if model == "sage":
            mag = mag + ax[:n] @ conv.lin_r.weight.double().abs().t()
        return (f + deg + 2) * U32 * (mag + bias.double().abs())
    assert conv.concat, "the bound below is for heads concatenated (hidden layers)"
    heads, channels = conv.heads, conv.out_channels
    h = (ax @ conv.lin.weight.double().abs().t()).view(-1, heads, channels)  # (N, H, C) |x| |W|
    a_src = (h * conv.att_src.double().abs()).sum(-1)  # (N, H) magnitude of each logit term
    a_dst = (h[:n] * conv.att_dst.double().abs()).sum(-1)
    expand = rows.unsqueeze(1).expand(-1, heads)
    logits = torch.zeros(n, heads, dtype=torch.float64).scatter_reduce(
        0, expand, a_src[cols] + a_dst[rows], reduce="amax", include_self=False)  # (n, H) largest L per row
    largest_h = torch.zeros(n, heads, channels, dtype=torch.float64).scatter_reduce(
        0, expand.unsqueeze(2).expand(-1, -1, channels), h[cols], reduce="amax", include_self=False)
    # sum_j alpha_ij |h_j| <= the largest |h_j| of the row (the alphas are positive and sum to 1)
    factor = (f + 2 * deg + 4).unsqueeze(2) + 2 * (f + channels + 2) * logits.unsqueeze(2)  # (n, H, 1)
    return U32 * (factor * largest_h).reshape(n, heads * channels) + U32 * conv.bias.double().abs()


@pytest.mark.parametrize("setting", ["transductive", "inductive"])
@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_aggregating_once_gives_the_per_round_conv_outputs(tiny, model: str, setting: str) -> None:
    _, _, partition = tiny
    for out, _, _, _ in _layer_outputs(str(partition.path), model, setting, sparse=False):
        for view in VIEWS:
            aggregated, per_round, pyg = out[view]
            torch.testing.assert_close(aggregated, per_round, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(aggregated, pyg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_the_block_propagation_equals_pyg_conv(tiny, model: str) -> None:
    """Our propagation and PyG's conv, both in float32, are each within float32 rounding of PyG's
    conv in float64 (``float32_error_bound``): they sum in different orders, so they agree to
    rounding, not to a fixed tolerance."""
    _, _, partition = tiny

    def rank(comm):
        data = load_part(Path(partition.path), comm.rank)
        ctx = make_context(comm, data, small_config(model=model, heads=2))
        inputs = gather_inputs(ctx, 1, dict.fromkeys(VIEWS, data.x))
        module = new_layer(ctx, 1, data.x.shape[1])
        graph = ctx.graphs["full"]
        x, conv = inputs["full"], module.block.conv
        with torch.no_grad():
            ours = module.block.propagate(x, graph)
            pyg, exact = (_pyg(conv, model, x.to(dtype), graph.adj.col, graph.adj.row_index(), graph.adj.val,
                               graph.num_owned) for dtype in (torch.float32, torch.float64))
            bound = float32_error_bound(conv, model, x, graph)
        return ours, pyg, exact, bound

    for (ours, pyg, exact, bound), _ in run_threads(rank, K):
        # ours and PyG's float32 conv are each within float32 rounding of the exact (float64) conv
        for name, result in (("ours", ours), ("pyg", pyg)):
            error = (result.double() - exact).abs()
            assert (error <= bound).all(), f"{name}: error / bound up to {(error / bound).max().item():.2f}"
        assert bound.max() < 1e-3  # the bound is tight enough to catch a wrong edge, weight or softmax


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_sparse_features_give_the_dense_layer1_outputs_and_travel_sparse(tiny, model: str) -> None:
    _, _, partition = tiny
    dense = _layer_outputs(str(partition.path), model, "transductive", sparse=False)
    sparse = _layer_outputs(str(partition.path), model, "transductive", sparse=True)
    for (out_d, halo_d, rows_d, _), (out_s, halo_s, rows_s, _) in zip(dense, sparse):
        torch.testing.assert_close(halo_s, halo_d, rtol=0, atol=0)  # the sparse encoding round-trips exactly
        for view in VIEWS:
            torch.testing.assert_close(out_s[view][0], out_d[view][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out_s[view][1], out_d[view][1], rtol=1e-5, atol=1e-5)
        # the features crossed in the sparse encoding: fewer bytes than dense rows, plus the
        # payload sizes (8 B to each peer, control)
        sparse_bytes = sum(r[6] for r in rows_s if r[3] == "halo_features")
        dense_bytes = sum(r[6] for r in rows_d if r[3] == "halo_features")
        assert 0 < sparse_bytes and sum(r[6] for r in rows_s if r[3] == "control") == 8 * (K - 1)
        assert len(halo_d) == 0 or dense_bytes > 0


def test_sparse_halo_bytes_equal_the_encoded_rows(tiny) -> None:
    """Each sparse feature message logs exactly the bytes of its encoded rows."""
    _, _, partition = tiny

    def rank(comm):
        data = load_part(Path(partition.path), comm.rank)
        data.x = SparseMatrix.from_dense(data.x)
        ctx = make_context(comm, data, small_config())
        start = len(comm.log.rows)
        module = new_layer(ctx, 1, data.x.shape[1])
        LayerInputs.exchanged(ctx, 1, ctx.config.model, dict.fromkeys(VIEWS, data.x), [lambda x: x])
        expected = {j: encoded_rows_nbytes(data.x.select_rows(torch.from_numpy(idx)), "none")
                    for j, idx in enumerate(ctx.plans["full"].send_index) if j != comm.rank and len(idx)}
        logged = {r[5]: r[6] for r in comm.log.rows[start:] if r[3] == "halo_features"}
        return expected, logged

    for (expected, logged), _ in run_threads(rank, K):
        assert logged == expected


def test_row_normalisation_changes_only_the_features(cora, tiny) -> None:
    """``normalize_features`` divides each node's features by their sum and touches nothing else;
    ``auto`` leaves them as they are (layer 1 chooses between both on validation: test_recipe_search)."""
    import dataclasses

    import numpy as np

    from retexo_core.stages import prepare_features

    data = load_part(cora.partitions["random"].path, 1)
    rows = prepare_features(data, small_config(normalize_features="rows"))
    x, normalised = data.x.to_dense(), rows.x.to_dense()
    sums = x.sum(dim=1, keepdim=True)
    expected = torch.where(sums > 0, x / torch.where(sums > 0, sums, torch.ones_like(sums)), x)
    assert torch.equal(normalised, expected)
    for field in dataclasses.fields(data):
        if field.name == "masks":
            assert all(torch.equal(rows.masks[s], data.masks[s]) for s in data.masks)
        elif field.name != "x":
            before, after = getattr(data, field.name), getattr(rows, field.name)
            assert (torch.equal(after, before) if isinstance(before, torch.Tensor)
                    else np.array_equal(after, before)), field.name
    assert prepare_features(data, small_config(normalize_features="none")) is data
    assert prepare_features(data, small_config(normalize_features="auto")) is data
    assert data.features_nonnegative and not load_part(tiny[2].path, 0).features_nonnegative  # auto's candidates


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_bns_graph_scales_the_sampled_sources_and_drops_the_others(model: str) -> None:
    """BNS-GCN's per-epoch graph: GCN and SAGE keep the full graph's weights, multiplied by each
    source's scale (0 = not sampled, 1/rate = sampled); GAT is the graph built from the edges of
    the sampled sources only."""
    import numpy as np

    from retexo_core.halo import in_degree
    from retexo_core.models import local_graph

    rng = np.random.default_rng(3)
    n, h = 20, 12
    src, dst = rng.integers(0, n + h, 150), rng.integers(0, n, 150)
    keys = np.unique(src * (n + h) + dst)
    src, dst = keys // (n + h), keys % (n + h)
    degree = torch.from_numpy(in_degree(n + h, src, dst))
    scale = torch.ones(n + h)
    scale[n:] = 2.5
    scale[n + torch.from_numpy(rng.choice(h, 5, replace=False))] = 0.0
    full = local_graph(model, src, dst, degree, n, n + h)
    sampled = full.reweighted_sources(scale)
    if model == "gat":
        rebuilt = local_graph(model, src, dst, degree, n, n + h, keep=scale.numpy()[src] > 0)
        torch.testing.assert_close(sampled.adj.to_dense(), rebuilt.adj.to_dense())
        assert sampled.adj.nnz == rebuilt.adj.nnz
    else:
        torch.testing.assert_close(sampled.adj.to_dense(), full.adj.to_dense() * scale[None, :])