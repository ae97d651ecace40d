"""Sparse kernels (retexo_core.sparse) and the sparse-row wire codec agree with dense references."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch
from torch_geometric.nn import GATConv

from retexo_core.comm.sparse_codec import decode_rows, encode_rows, encoded_rows_nbytes
from retexo_core.sparse import (
    SparseMatrix,
    dropout,
    gat_aggregate,
    matmul,
    sparse_dropout,
    sparse_sparse,
    spmm,
)


def _random_sparse(rows: int, cols: int, density: float, seed: int, empty_rows: int = 0,
                   empty_cols: int = 0) -> tuple[SparseMatrix, torch.Tensor]:
    """A random matrix whose first ``empty_rows`` rows and last ``empty_cols`` columns are empty,
    as (SparseMatrix, the same matrix dense float32)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) < density
    mask[:empty_rows] = False
    if empty_cols:
        mask[:, cols - empty_cols:] = False
    dense = torch.randn(rows, cols, generator=g) * mask
    row, col = torch.nonzero(mask, as_tuple=True)
    perm = torch.randperm(row.numel(), generator=g)  # unsorted input
    return SparseMatrix.from_coo(row[perm], col[perm], dense[row, col][perm], (rows, cols)), dense


def test_from_coo_sums_duplicates_and_builds_transpose() -> None:
    row = np.array([2, 0, 2, 1, 0, 2])
    col = np.array([1, 3, 1, 0, 3, 0])
    val = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=np.float32)
    a = SparseMatrix.from_coo(row, col, val, (4, 5))
    expected = torch.zeros(4, 5)
    for r, c, v in zip(row, col, val):
        expected[r, c] += float(v)
    assert a.nnz == 4 and a.density == pytest.approx(4 / 20)
    assert torch.equal(a.to_dense(), expected)
    assert torch.equal(a.row_index(), torch.tensor([0, 1, 2, 2]))
    assert torch.equal(a.col, torch.tensor([3, 0, 0, 1]))
    assert torch.equal(a.t().to_dense(), expected.t())
    assert torch.equal(a.t().t().to_dense(), expected)
    assert torch.equal(a.t().val, a.val[a.t_perm])
    with pytest.raises(ValueError):
        SparseMatrix.from_coo(row, col, val, (4, 5), sum_duplicates=False)


def test_scipy_round_trip_and_sparse_product() -> None:
    a, dense_a = _random_sparse(7, 9, 0.3, seed=1, empty_rows=2, empty_cols=1)
    b, dense_b = _random_sparse(9, 4, 0.4, seed=2)
    assert np.array_equal(a.to_scipy().toarray(), dense_a.numpy())
    back = SparseMatrix.from_scipy(a.to_scipy())
    assert torch.equal(back.crow, a.crow) and torch.equal(back.col, a.col) and torch.equal(back.val, a.val)
    assert torch.allclose(sparse_sparse(a, b).to_dense(), dense_a @ dense_b, atol=1e-5)
    coo = scipy.sparse.coo_matrix(([1.0, 2.0], ([0, 0], [1, 1])), shape=(2, 2))  # duplicates in scipy
    assert torch.equal(SparseMatrix.from_scipy(coo).to_dense(), torch.tensor([[0.0, 3.0], [0.0, 0.0]]))


def test_empty_matrices() -> None:
    for shape in [(0, 0), (0, 3), (3, 0), (3, 4)]:
        a = SparseMatrix.from_coo(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), shape)
        assert a.nnz == 0 and a.density == 0.0 and a.to_dense().shape == shape
        assert torch.equal(spmm(a, torch.ones(shape[1], 2)), torch.zeros(shape[0], 2))
        assert spmm(a, torch.ones(shape[1], 0)).shape == (shape[0], 0)  # no columns
        assert a.t().shape == (shape[1], shape[0])


def test_select_rows_matches_dense() -> None:
    a, dense = _random_sparse(10, 8, 0.3, seed=3, empty_rows=3)
    index = torch.tensor([5, 0, 5, 9, 1, 2])  # any order, repeats, empty rows
    sub = a.select_rows(index)
    assert sub.shape == (6, 8)
    assert torch.equal(sub.to_dense(), dense[index])
    assert torch.equal(sub.t().to_dense(), dense[index].t())
    assert a.select_rows(torch.zeros(0, dtype=torch.int64)).shape == (0, 8)
    with pytest.raises(ValueError):
        a.select_rows(torch.tensor([10]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spmm_forward_and_gradients_match_dense(dtype: torch.dtype) -> None:
    a, dense = _random_sparse(12, 15, 0.25, seed=4, empty_rows=2, empty_cols=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(15, 6, generator=g, dtype=dtype, requires_grad=True)
    upstream = torch.randn(12, 6, generator=g, dtype=dtype)
    val = a.val.clone().requires_grad_(True)
    out = spmm(a.with_values(val), x)
    assert out.dtype == dtype
    (out * upstream).sum().backward()

    x_ref = x.detach().clone().requires_grad_(True)
    dense_ref = dense.clone().requires_grad_(True)
    out_ref = dense_ref.to(dtype) @ x_ref
    (out_ref * upstream).sum().backward()
    mask = dense != 0
    assert torch.allclose(out, out_ref, atol=1e-5)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    # value gradient = the dense gradient at the stored positions (in storage order)
    assert dense_ref.grad is not None
    assert torch.allclose(val.grad, dense_ref.grad[a.row_index(), a.col], atol=1e-5)
    assert torch.equal(a.to_dense() != 0, mask)
    # a 1-D right-hand side
    v = torch.randn(15, generator=g, dtype=dtype)
    assert torch.allclose(spmm(a, v), dense.to(dtype) @ v, atol=1e-5)


def test_gradients_through_transpose_and_select_rows() -> None:
    a, dense = _random_sparse(9, 7, 0.4, seed=6, empty_cols=1)
    g = torch.Generator().manual_seed(7)
    val = a.val.clone().requires_grad_(True)
    x = torch.randn(9, 3, generator=g)
    upstream = torch.randn(7, 3, generator=g)
    index = torch.tensor([3, 1, 3])
    (spmm(a.with_values(val).t(), x) * upstream).sum().backward()
    dense_ref = dense.clone().requires_grad_(True)
    (dense_ref.t() @ x * upstream).sum().backward()
    assert dense_ref.grad is not None
    assert torch.allclose(val.grad, dense_ref.grad[a.row_index(), a.col], atol=1e-5)
    y = torch.randn(7, 3, generator=g)
    assert torch.allclose(spmm(a.select_rows(index), y), dense[index] @ y, atol=1e-5)
    assert torch.autograd.gradcheck(
        lambda v, z: spmm(a.with_values(v), z),
        (a.val.double().requires_grad_(True), torch.randn(7, 2, generator=g, dtype=torch.float64, requires_grad=True)),
    )


def test_dropout_uses_only_the_generator() -> None:
    x = torch.ones(200, 30)
    state = torch.get_rng_state()
    first = dropout(x, 0.3, torch.Generator().manual_seed(11), training=True)
    second = dropout(x, 0.3, torch.Generator().manual_seed(11), training=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, second)
    kept = first != 0
    assert torch.allclose(first[kept], torch.full_like(first[kept], 1 / 0.7))
    assert 0.6 < kept.float().mean().item() < 0.8
    assert dropout(x, 0.3, None, training=False) is x
    assert dropout(x, 0.0, None, training=True) is x
    with pytest.raises(ValueError):
        dropout(x, 0.3, None, training=True)


def test_sparse_dropout_keeps_structure() -> None:
    a, _ = _random_sparse(30, 40, 0.2, seed=8)
    a = a.with_values(torch.cat([torch.zeros(5), a.val[5:]]))  # some stored zeros
    state = torch.get_rng_state()
    b = sparse_dropout(a, 0.5, torch.Generator().manual_seed(12), training=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(b.crow, a.crow) and torch.equal(b.col, a.col)
    assert torch.equal(b.val[:5], torch.zeros(5))
    kept = b.val != 0
    assert torch.allclose(b.val[kept], a.val[kept] * 2.0)
    assert 0 < int(kept.sum()) < a.nnz
    c = sparse_dropout(a, 0.5, torch.Generator().manual_seed(12), training=True)
    assert torch.equal(b.val, c.val)
    assert sparse_dropout(a, 0.5, None, training=False) is a


def test_matmul_sparse_equals_dense() -> None:
    a, dense = _random_sparse(20, 16, 0.2, seed=9, empty_rows=2)
    lin = torch.nn.Linear(16, 5, bias=False)
    out_sparse = matmul(a, lin.weight.t())
    out_sparse.square().sum().backward()
    assert lin.weight.grad is not None
    grad_sparse = lin.weight.grad.clone()
    lin.weight.grad = None
    out_dense = matmul(dense, lin.weight.t())
    out_dense.square().sum().backward()
    assert torch.allclose(out_sparse, out_dense, atol=1e-5)
    assert torch.allclose(grad_sparse, lin.weight.grad, atol=1e-5)


def _gat_case(num_nodes: int, features: int, channels: int, heads: int, seed: int
              ) -> tuple[GATConv, torch.Tensor, torch.Tensor, SparseMatrix]:
    g = torch.Generator().manual_seed(seed)
    conv = GATConv(features, channels, heads=heads, concat=True, add_self_loops=True)
    with torch.no_grad():  # replace the (global-RNG) initialisation by parameters drawn from g
        for parameter in conv.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.5)
    x = torch.randn(num_nodes, features, generator=g)
    src = torch.randint(0, num_nodes, (4 * num_nodes,), generator=g)
    dst = torch.randint(0, num_nodes, (4 * num_nodes,), generator=g)
    keep = src != dst
    edge_index = torch.unique(torch.stack([src[keep], dst[keep]]), dim=1)
    loops = torch.arange(num_nodes)
    adj = SparseMatrix.from_coo(torch.cat([edge_index[1], loops]), torch.cat([edge_index[0], loops]), None,
                                (num_nodes, num_nodes))
    return conv, x, edge_index, adj


def _our_gat(conv: GATConv, x: torch.Tensor, adj: SparseMatrix) -> torch.Tensor:
    heads, channels = conv.heads, conv.out_channels
    h = conv.lin(x).view(-1, heads, channels)
    a_src = (h * conv.att_src).sum(-1)
    a_dst = (h[: adj.shape[0]] * conv.att_dst).sum(-1)
    return gat_aggregate(adj, h, a_src, a_dst, conv.negative_slope).reshape(adj.shape[0], -1) + conv.bias


def test_gat_aggregate_matches_gatconv() -> None:
    conv, x, edge_index, adj = _gat_case(40, 6, 5, 3, seed=13)
    upstream = torch.randn(40, 15, generator=torch.Generator().manual_seed(14))
    x_ours = x.clone().requires_grad_(True)
    ours = _our_gat(conv, x_ours, adj)
    (ours * upstream).sum().backward()
    ours_param_grads = [p.grad.clone() for p in conv.parameters()]  # type: ignore[union-attr]
    conv.zero_grad()
    x_ref = x.clone().requires_grad_(True)
    ref = conv(x_ref, edge_index)
    (ref * upstream).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(x_ours.grad, x_ref.grad, atol=1e-5)
    for mine, theirs in zip(ours_param_grads, conv.parameters()):
        assert torch.allclose(mine, theirs.grad, atol=1e-5)


def test_gat_aggregate_on_owned_rows_and_empty_rows() -> None:
    conv, x, edge_index, adj = _gat_case(30, 4, 3, 2, seed=15)
    owned = 12  # rows = the first 12 nodes (targets), columns = all 30 (sources)
    with torch.no_grad():
        ours = _our_gat(conv, x, adj.select_rows(torch.arange(owned)))
        ref = conv(x, edge_index)[:owned]
    assert torch.allclose(ours, ref, atol=1e-5)
    empty = SparseMatrix.from_coo(torch.tensor([1]), torch.tensor([2]), None, (3, 4))  # rows 0 and 2 have no edge
    h = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(16), requires_grad=True)
    out = gat_aggregate(empty, h, torch.zeros(4, 2), torch.zeros(3, 2))
    assert torch.equal(out[0], torch.zeros(2, 3)) and torch.equal(out[2], torch.zeros(2, 3))
    assert torch.equal(out[1], h[2])
    out.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_gat_aggregate_is_stable_for_extreme_logits() -> None:
    adj, dense = _random_sparse(6, 8, 0.5, seed=18)
    adj = adj.with_values(torch.ones(adj.nnz))
    g = torch.Generator().manual_seed(19)
    h = torch.randn(8, 2, 3, generator=g)
    a_src = torch.randn(8, 2, generator=g) * 10 + torch.tensor([1000.0, -1000.0])  # head 0 huge, head 1 tiny
    a_dst = torch.randn(6, 2, generator=g) * 10
    out = gat_aggregate(adj, h, a_src, a_dst)
    mask = dense != 0
    for k in range(2):  # dense reference: masked softmax per row in float64
        logits = torch.nn.functional.leaky_relu(a_src[:, k].double()[None, :] + a_dst[:, k].double()[:, None], 0.2)
        alpha = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=1).nan_to_num(0.0)
        assert torch.allclose(out[:, k].double(), alpha @ h[:, k].double(), atol=1e-4)


@pytest.mark.parametrize("compression", ["none", "fp16", "int8"])
def test_sparse_rows_codec_round_trip(compression: str) -> None:
    a, dense = _random_sparse(11, 50, 0.1, seed=17, empty_rows=3)
    payload = encode_rows(a, compression)  # type: ignore[arg-type]
    assert payload.dtype == torch.uint8
    values = {"none": 4 * a.nnz, "fp16": 2 * a.nnz, "int8": 4 * 11 + a.nnz}[compression]
    assert payload.numel() == encoded_rows_nbytes(a, compression) == 4 * 11 + 4 * a.nnz + values  # type: ignore[arg-type]
    for offset in (0, 1, 3, 8):  # a slice of a larger, unaligned receive buffer
        buffer = torch.cat([torch.full((offset,), 7, dtype=torch.uint8), payload, torch.full((5,), 9, dtype=torch.uint8)])
        back = decode_rows(buffer[offset: offset + payload.numel()], 11, 50, compression)  # type: ignore[arg-type]
        assert back.shape == (11, 50)
        assert torch.equal(back.crow, a.crow) and torch.equal(back.col, a.col)
        if compression == "none":
            assert torch.equal(back.val.view(torch.int32), a.val.view(torch.int32))  # bit-identical
        else:
            peak = dense.abs().amax(dim=1)[a.row_index()]
            tolerance = peak * (1e-3 if compression == "fp16" else 0.5 / 127) + 1e-7
            assert bool(((back.val - a.val).abs() <= tolerance).all())
        assert torch.allclose(back.to_dense(), dense, atol=float(dense.abs().max()) * 0.5 / 127 + 1e-6)


@pytest.mark.parametrize("compression", ["none", "fp16", "int8"])
def test_sparse_rows_codec_empty_blocks(compression: str) -> None:
    none = SparseMatrix.from_coo(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), (0, 6))
    assert encode_rows(none, compression).numel() == encoded_rows_nbytes(none, compression) == 0  # type: ignore[arg-type]
    assert decode_rows(torch.empty(0, dtype=torch.uint8), 0, 6, compression).shape == (0, 6)  # type: ignore[arg-type]
    blank = SparseMatrix.from_coo(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), (3, 6))
    payload = encode_rows(blank, compression)  # type: ignore[arg-type]
    assert payload.numel() == encoded_rows_nbytes(blank, compression)  # type: ignore[arg-type]
    assert decode_rows(payload, 3, 6, compression).nnz == 0  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode_rows(payload[:-1], 3, 6, compression)  # type: ignore[arg-type]


def test_gat_attention_dropout_drops_whole_coefficients() -> None:
    """Equal logits give alpha = 1 / degree; dropout at 0.5 keeps each coefficient (scaled by 2) or
    drops it, so with h = 1 every row's output is 2 x (kept edges) / degree; the same seed draws the
    same coefficients, and rate 0 is the plain aggregation."""
    adj, _ = _random_sparse(20, 30, 0.3, seed=21)
    degree = torch.bincount(adj.row_index(), minlength=20).double()
    h = torch.ones(30, 2, 1)
    zeros_src, zeros_dst = torch.zeros(30, 2), torch.zeros(20, 2)
    plain = gat_aggregate(adj, h, zeros_src, zeros_dst)
    assert torch.equal(gat_aggregate(adj, h, zeros_src, zeros_dst, 0.2, 0.0, torch.Generator().manual_seed(3)), plain)
    out = gat_aggregate(adj, h, zeros_src, zeros_dst, 0.2, 0.5, torch.Generator().manual_seed(3))
    kept = out.squeeze(2).double() * degree[:, None] / 2
    assert torch.allclose(kept, kept.round(), atol=1e-4)  # whole coefficients, kept or dropped
    assert not torch.allclose(out, plain)
    again = gat_aggregate(adj, h, zeros_src, zeros_dst, 0.2, 0.5, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)
