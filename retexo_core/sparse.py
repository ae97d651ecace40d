"""Sparse-matrix kernels for message passing as matrix products (torch.sparse CSR, on the CPU or a GPU).

A graph layer's aggregation is ``A @ X`` with a constant CSR matrix ``A`` (rows = target nodes,
columns = source nodes) and dense node features ``X``. :class:`SparseMatrix` stores ``A`` together
with the structure of ``A^T`` so that the backward pass (``grad_X = A^T @ grad``) never has to
transpose a CSR tensor, and :func:`spmm` is the autograd function tying both together; it also
differentiates through the stored values, which is what attention (:func:`gat_aggregate`) and
learned edge weights need.

A matrix lives on one device (``SparseMatrix.to``); every product, transpose and selection runs
there (products: on the CPU a weighted ``embedding_bag`` sum, on CUDA torch's CSR kernels, cuSPARSE).
Randomness (dropout) is always drawn from an explicit ``torch.Generator`` of the data's device.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse
import torch
import torch.nn.functional as F
from torch import Tensor

_BETA_WARNING = "Sparse CSR tensor support is in beta state"
warnings.filterwarnings("ignore", message=_BETA_WARNING, category=UserWarning)
with warnings.catch_warnings():
    # torch emits the warning once per process: spend it here, so that it stays silent even
    # where the filter above is reset (e.g. pytest restores the filters around every test)
    warnings.filterwarnings("ignore", message=_BETA_WARNING, category=UserWarning)
    torch.sparse_csr_tensor(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                            size=(0, 0), check_invariants=False)

_INDEX = torch.int64


def _as_tensor(values: np.ndarray | Tensor, dtype: torch.dtype) -> Tensor:
    if isinstance(values, Tensor):
        return values.to(dtype)
    return torch.as_tensor(np.asarray(values)).to(dtype)


def _crow_from_counts(counts: Tensor) -> Tensor:
    """(rows,) entries per row -> (rows + 1,) int64 CSR row pointer."""
    crow = torch.zeros(counts.numel() + 1, dtype=_INDEX, device=counts.device)
    torch.cumsum(counts, dim=0, out=crow[1:])
    return crow


def _rows_of(crow: Tensor, nnz: int) -> Tensor:
    """(rows + 1,) row pointer -> (nnz,) int64 row of each stored entry."""
    rows = crow.numel() - 1
    return torch.repeat_interleave(torch.arange(rows, dtype=_INDEX, device=crow.device), crow.diff(), output_size=nnz)


@dataclass(frozen=True, eq=False)
class SparseMatrix:
    """A constant CSR matrix (rows x cols, float32 values) plus the structure of its transpose,
    for products A @ X with autograd to X (and, optionally, to the values).

    crow: (rows + 1,) int64 row pointer.
    col: (nnz,) int64 column of each entry, sorted within each row, no duplicates.
    val: (nnz,) values (float32; :meth:`with_values` accepts any floating dtype, e.g. attention
        weights that require grad).
    shape: (rows, cols).
    t_crow: (cols + 1,) int64 row pointer of A^T.
    t_col: (nnz,) int64 column (= row of A) of each entry of A^T in its CSR order.
    t_perm: (nnz,) int64: A^T's values in its CSR order are ``val[t_perm]``.
    """

    crow: Tensor
    col: Tensor
    val: Tensor
    shape: tuple[int, int]
    t_crow: Tensor
    t_col: Tensor
    t_perm: Tensor

    # ------------------------------------------------------------------ construction

    @staticmethod
    def from_csr(crow: np.ndarray | Tensor, col: np.ndarray | Tensor, val: np.ndarray | Tensor,
                 shape: tuple[int, int], check: bool = True) -> SparseMatrix:
        """From CSR arrays whose columns are already sorted and unique within each row.

        Builds the transpose structure (O(nnz log nnz)). ``check`` validates the row pointer and
        the columns (range, strictly increasing within each row) and raises ``ValueError``.
        """
        rows, cols = int(shape[0]), int(shape[1])
        crow_t = _as_tensor(crow, _INDEX).contiguous()
        col_t = _as_tensor(col, _INDEX).contiguous()
        val_t = _as_tensor(val, torch.float32)
        if check:
            _check_csr(crow_t, col_t, val_t, rows, cols)
        return _with_transpose(crow_t, col_t, val_t.contiguous(), (rows, cols))

    @staticmethod
    def from_coo(row: np.ndarray | Tensor, col: np.ndarray | Tensor, val: np.ndarray | Tensor | None,
                 shape: tuple[int, int], sum_duplicates: bool = True) -> SparseMatrix:
        """From (row, col, val) triplets in any order; ``val=None`` means all ones.

        Entries are sorted by (row, col). Duplicate positions are summed, or, with
        ``sum_duplicates=False``, rejected with ``ValueError``.
        """
        rows, cols = int(shape[0]), int(shape[1])
        row_t = _as_tensor(row, _INDEX).reshape(-1)  # the matrix is built on the rows' device
        col_t = _as_tensor(col, _INDEX).reshape(-1).to(row_t.device)
        val_t = (torch.ones(row_t.numel(), device=row_t.device) if val is None
                 else _as_tensor(val, torch.float32).reshape(-1).to(row_t.device))
        if not row_t.numel() == col_t.numel() == val_t.numel():
            raise ValueError(f"row, col, val lengths differ: {row_t.numel()}, {col_t.numel()}, {val_t.numel()}")
        if row_t.numel():
            if int(row_t.min()) < 0 or int(row_t.max()) >= rows:
                raise ValueError(f"row index out of range [0, {rows})")
            if int(col_t.min()) < 0 or int(col_t.max()) >= cols:
                raise ValueError(f"column index out of range [0, {cols})")
        key = row_t * cols + col_t
        key, order = torch.sort(key, stable=True)
        unique, inverse = torch.unique_consecutive(key, return_inverse=True)
        if unique.numel() < key.numel():
            if not sum_duplicates:
                raise ValueError("duplicate entries and sum_duplicates=False")
            val_t = torch.zeros(unique.numel(), dtype=torch.float32, device=key.device).index_add_(0, inverse, val_t[order])
        else:
            val_t = val_t[order]
        row_t, col_t = unique // cols if cols else unique, unique % cols if cols else unique
        crow = _crow_from_counts(torch.bincount(row_t, minlength=rows))
        return _with_transpose(crow, col_t, val_t.contiguous(), (rows, cols))

    @staticmethod
    def from_scipy(m: scipy.sparse.spmatrix | scipy.sparse.sparray) -> SparseMatrix:
        """From any scipy sparse matrix (duplicates summed, values cast to float32)."""
        csr = scipy.sparse.csr_matrix(m, dtype=np.float32, copy=True)
        csr.sum_duplicates()  # also sorts the indices
        return SparseMatrix.from_csr(csr.indptr.astype(np.int64), csr.indices.astype(np.int64),
                                     csr.data, (int(csr.shape[0]), int(csr.shape[1])), check=False)

    @staticmethod
    def from_dense(x: Tensor) -> SparseMatrix:
        """(rows, cols) dense -> its nonzero entries (values detached, float32)."""
        row, col = torch.nonzero(x, as_tuple=True)
        return SparseMatrix.from_coo(row, col, x.detach()[row, col], (x.shape[0], x.shape[1]))

    # ------------------------------------------------------------------ properties

    @property
    def nnz(self) -> int:
        """Number of stored entries."""
        return int(self.col.numel())

    @property
    def density(self) -> float:
        """nnz / (rows * cols); 0 for an empty shape."""
        cells = self.shape[0] * self.shape[1]
        return self.nnz / cells if cells else 0.0

    @property
    def device(self) -> torch.device:
        """Where the matrix is stored (its products run there)."""
        return self.crow.device

    def to(self, device: torch.device | str) -> SparseMatrix:
        """The matrix on ``device`` (itself when it is there already)."""
        device = torch.device(device)
        if self.device == device:
            return self
        return SparseMatrix(*(t.to(device) for t in (self.crow, self.col, self.val)), self.shape,
                            *(t.to(device) for t in (self.t_crow, self.t_col, self.t_perm)))

    def row_index(self) -> Tensor:
        """(nnz,) int64 row of each stored entry, in storage order."""
        return _rows_of(self.crow, self.nnz)

    # ------------------------------------------------------------------ conversions

    def to_scipy(self) -> scipy.sparse.csr_matrix:
        """A float32 scipy CSR copy (values detached)."""
        return scipy.sparse.csr_matrix(
            (self.val.detach().to("cpu", torch.float32).numpy().copy(), self.col.cpu().numpy().copy(),
             self.crow.cpu().numpy().copy()),
            shape=self.shape,
        )

    def to_dense(self) -> Tensor:
        """(rows, cols) dense tensor in the values' dtype; differentiable w.r.t. the values."""
        out = torch.zeros(self.shape, dtype=self.val.dtype, device=self.device)
        return out.index_put((self.row_index(), self.col), self.val)

    def to_torch(self, dtype: torch.dtype | None = None) -> Tensor:
        """A ``torch.sparse_csr_tensor`` view of the matrix (values detached, cast to ``dtype``)."""
        return _csr_tensor(self.crow, self.col, self.val.detach(), self.shape, dtype or self.val.dtype)

    # ------------------------------------------------------------------ derived matrices

    def with_values(self, val: Tensor) -> SparseMatrix:
        """Same structure, new (nnz,) values (not re-sorted; O(1) apart from a shape check)."""
        if val.dim() != 1 or val.numel() != self.nnz:
            raise ValueError(f"expected ({self.nnz},) values, got {tuple(val.shape)}")
        return dataclasses.replace(self, val=val)

    def t(self) -> SparseMatrix:
        """The transpose (cols x rows), reusing the stored structure; values stay differentiable."""
        inverse = torch.empty_like(self.t_perm)
        inverse[self.t_perm] = torch.arange(self.nnz, dtype=_INDEX, device=self.device)
        return SparseMatrix(self.t_crow, self.t_col, self.val[self.t_perm], (self.shape[1], self.shape[0]),
                            self.crow, self.col, inverse)

    def columns(self, start: int, stop: int) -> SparseMatrix:
        """Columns [start, stop) as a (rows, stop - start) matrix (through the stored transpose)."""
        return self.t().select_rows(torch.arange(start, stop, dtype=_INDEX, device=self.device)).t()

    def select_rows(self, index: Tensor) -> SparseMatrix:
        """Rows ``index`` (any order, repeats allowed) as a (len(index), cols) matrix.

        Values are gathered (differentiable); the transpose structure is rebuilt (O(k log k) for
        the k selected entries).
        """
        index = index.to(self.device, _INDEX).reshape(-1)
        rows = self.shape[0]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
            raise ValueError(f"row index out of range [0, {rows})")
        start = self.crow[index]
        counts = self.crow[index + 1] - start
        crow = _crow_from_counts(counts)
        total = int(crow[-1])
        # position of every selected entry = start of its source row + offset within the row
        shift = torch.repeat_interleave(start - crow[:-1], counts, output_size=total)
        pos = torch.arange(total, dtype=_INDEX, device=self.device) + shift
        return _with_transpose(crow, self.col[pos], self.val[pos], (int(index.numel()), self.shape[1]))


def _check_csr(crow: Tensor, col: Tensor, val: Tensor, rows: int, cols: int) -> None:
    if crow.dim() != 1 or crow.numel() != rows + 1:
        raise ValueError(f"crow must have {rows + 1} entries, got {tuple(crow.shape)}")
    nnz = col.numel()
    if col.dim() != 1 or val.dim() != 1 or val.numel() != nnz:
        raise ValueError(f"col and val must be 1-D of equal length, got {tuple(col.shape)}, {tuple(val.shape)}")
    if int(crow[0]) != 0 or int(crow[-1]) != nnz or bool((crow.diff() < 0).any()):
        raise ValueError("crow must start at 0, be non-decreasing and end at nnz")
    if nnz:
        if int(col.min()) < 0 or int(col.max()) >= cols:
            raise ValueError(f"column index out of range [0, {cols})")
        same_row = _rows_of(crow, nnz).diff() == 0
        if bool((col.diff()[same_row] <= 0).any()):
            raise ValueError("columns must be strictly increasing within each row")


def _with_transpose(crow: Tensor, col: Tensor, val: Tensor, shape: tuple[int, int]) -> SparseMatrix:
    """Completes a valid CSR (sorted, unique columns per row) with the structure of its transpose."""
    rows, cols = shape
    nnz = int(col.numel())
    # entries are stored row-major, so a stable sort by column yields A^T's (col, row) order
    t_perm = torch.sort(col, stable=True).indices if nnz else torch.zeros(0, dtype=_INDEX, device=col.device)
    t_col = _rows_of(crow, nnz)[t_perm]
    t_crow = _crow_from_counts(torch.bincount(col, minlength=cols) if nnz
                               else torch.zeros(cols, dtype=_INDEX, device=col.device))
    return SparseMatrix(crow, col, val, (rows, cols), t_crow, t_col, t_perm)


def _csr_tensor(crow: Tensor, col: Tensor, val: Tensor, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    return torch.sparse_csr_tensor(crow, col, val.to(dtype).contiguous(), size=shape, check_invariants=False)


# ---------------------------------------------------------------------- products


_NO_VALUES = torch.empty(0)


def _product(crow: Tensor, col: Tensor, val: Tensor, shape: tuple[int, int], x: Tensor) -> Tensor:
    """(rows, d) = A @ X for the CSR matrix (crow, col, val) of ``shape`` and dense (cols, d) X.

    On the CPU a weighted ``embedding_bag`` sum: each output row adds X's rows at its columns,
    scaled by the values, vectorised over d; torch's CSR product is 1.8 to 5.8 times slower there
    on one thread (``benchmarks/spmm_kernels.py``). On a GPU, cuSPARSE through a CSR tensor.
    """
    if x.device.type != "cpu":
        return _csr_tensor(crow, col, val, shape, x.dtype) @ x
    if x.shape[1] == 0:
        return x.new_zeros(shape[0], 0)
    # rows of X must be contiguous (a weight's transpose is not): strided rows take a path many times slower
    return F.embedding_bag(col, x.contiguous(), crow, mode="sum", per_sample_weights=val.to(x.dtype),
                           include_last_offset=True)


class _SpMM(torch.autograd.Function):
    """(rows, d) = A @ X with gradients to X (via the stored A^T) and to A's values."""

    @staticmethod
    def forward(ctx: Any, val: Tensor, x: Tensor, a: SparseMatrix) -> Tensor:  # type: ignore[override]
        ctx.a = dataclasses.replace(a, val=_NO_VALUES)  # structure only; tensors go to save_for_backward
        ctx.val_dtype = val.dtype
        need_val, need_x = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # grad_X needs the values, grad_val needs X: keep only what the backward will read
        ctx.save_for_backward(val if need_x else None, x if need_val else None)
        return _product(a.crow, a.col, val, a.shape, x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        a: SparseMatrix = ctx.a
        val, x = ctx.saved_tensors
        grad_val = grad_x = None
        if ctx.needs_input_grad[1]:
            transpose_val = val.index_select(0, a.t_perm)
            grad_x = _product(a.t_crow, a.t_col, transpose_val, (a.shape[1], a.shape[0]), grad)
        if ctx.needs_input_grad[0]:
            grad_val = _sampled_dot(a, grad, x).to(ctx.val_dtype)
        return grad_val, grad_x, None


def _sampled_dot(a: SparseMatrix, left: Tensor, right: Tensor) -> Tensor:
    """(nnz,) ``<left[row_e], right[col_e]>`` for every stored entry e of ``a``.

    left: (rows, d), right: (cols, d). Computed by torch's CSR sampled matmul (SDDMM), which
    works row by row and allocates nothing proportional to nnz * d.
    """
    if a.nnz == 0 or left.shape[1] == 0:
        return torch.zeros(a.nnz, dtype=left.dtype, device=left.device)
    # values of the sampling matrix must be finite zeros: beta * NaN would leak into the result
    pattern = _csr_tensor(a.crow, a.col, torch.zeros(a.nnz, dtype=left.dtype, device=left.device), a.shape, left.dtype)
    return torch.sparse.sampled_addmm(pattern, left, right.t(), beta=0.0).values()


def spmm(a: SparseMatrix, x: Tensor) -> Tensor:
    """A @ X: (rows, cols) sparse times (cols, d) or (cols,) dense -> (rows, d) or (rows,).

    The values are cast to ``x.dtype`` (float32 or float64). Differentiable w.r.t. ``x`` and,
    when ``a.val.requires_grad``, w.r.t. the values.
    """
    if x.shape[0] != a.shape[1] or x.dim() not in (1, 2):
        raise ValueError(f"cannot multiply {a.shape} by {tuple(x.shape)}")
    if x.dim() == 1:
        return _SpMM.apply(a.val, x.unsqueeze(1), a).squeeze(1)
    return _SpMM.apply(a.val, x, a)


def sparse_sparse(a: SparseMatrix, b: SparseMatrix) -> SparseMatrix:
    """A @ B for two sparse matrices (via scipy on the CPU, float32, the product back on B's device;
    values are not differentiated). Used once per layer, on frozen inputs."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {a.shape} by {b.shape}")
    return SparseMatrix.from_scipy(a.to_scipy() @ b.to_scipy()).to(b.device)


def matmul(x: Tensor | SparseMatrix, weight: Tensor) -> Tensor:
    """x @ weight for dense (n, f) or sparse (n, f) ``x`` and dense (f, out) ``weight`` -> (n, out)."""
    if isinstance(x, SparseMatrix):
        return spmm(x, weight)
    return x @ weight


# ---------------------------------------------------------------------- dropout


DROPOUT_LEVELS = 1 << 16  # p is applied in steps of 1/65536


def _keep_scale(shape: torch.Size, p: float, generator: torch.Generator | None) -> Tensor:
    """(shape) float32: 0 where an element is dropped, 1 / (1 - p') where it is kept.

    Random 16-bit integers, four per 64-bit draw from ``generator``, on the generator's device
    (uniform floats cost four to ten times more on a CPU), compared with ``p' = round(p * 65536) / 65536``; the kept elements
    are scaled by the exact 1 / (1 - p'), so the expectation is unchanged.
    """
    if generator is None:
        raise ValueError("dropout needs an explicit torch.Generator (the global RNG is never used)")
    numel = math.prod(shape)
    draws = torch.randint(-(1 << 63), (1 << 63) - 1, ((numel + 3) // 4,), dtype=torch.int64, generator=generator,
                          device=generator.device)
    levels = draws.view(torch.int16)[:numel].view(shape)  # uniform in [-32768, 32767]
    dropped = round(p * DROPOUT_LEVELS)
    keep = levels >= dropped - DROPOUT_LEVELS // 2
    return keep.to(torch.float32).mul_(DROPOUT_LEVELS / (DROPOUT_LEVELS - dropped))


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")


def dropout(x: Tensor, p: float, generator: torch.Generator | None, training: bool) -> Tensor:
    """Inverted dropout: zero each element with probability ``p``, scale the rest by 1 / (1 - p).

    Identity when not ``training`` or ``p == 0``; otherwise the mask is drawn from ``generator``
    (required), 16 random bits per element (see ``_keep_scale``).
    """
    _check_p(p)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    return _keep_scale(x.shape, p, generator).to(x.dtype).mul_(x)


def sparse_dropout(a: SparseMatrix, p: float, generator: torch.Generator | None, training: bool) -> SparseMatrix:
    """:func:`dropout` on the stored values of ``a`` (same structure; unstored entries stay zero)."""
    _check_p(p)
    if not training or p == 0.0:
        return a
    return a.with_values(dropout(a.val, p, generator, training))


# ---------------------------------------------------------------------- attention


def gat_aggregate(adj: SparseMatrix, h: Tensor, a_src: Tensor, a_dst: Tensor,
                  negative_slope: float = 0.2, attention_dropout: float = 0.0,
                  generator: torch.Generator | None = None) -> Tensor:
    """Multi-head graph attention (GAT) aggregation over a CSR adjacency.

    adj: (n, N) structure, rows = targets, columns = sources (values ignored); self loops are
        used as stored.
    h: (N, H, C) transformed source features; a_src: (N, H) source logits; a_dst: (n, H) target
        logits.
    For every stored edge i <- j: ``e_ij = leaky_relu(a_src[j] + a_dst[i])``; ``alpha`` is the
    softmax of ``e`` over row i, per head, then :func:`dropout` at rate ``attention_dropout`` (drawn
    from ``generator``; 0 when not training); ``out[i, k] = sum_j alpha_ijk h[j, k]``. Rows without
    edges give zeros. Returns (n, H, C), differentiable w.r.t. ``h``, ``a_src`` and ``a_dst``.
    Memory per edge is O(H); the aggregation is one :func:`spmm` per head.
    """
    n, num_src = adj.shape
    if h.dim() != 3 or h.shape[0] != num_src:
        raise ValueError(f"h must be ({num_src}, H, C), got {tuple(h.shape)}")
    heads = h.shape[1]
    if a_src.shape != (num_src, heads) or a_dst.shape != (n, heads):
        raise ValueError(f"a_src must be ({num_src}, {heads}) and a_dst ({n}, {heads}), "
                         f"got {tuple(a_src.shape)}, {tuple(a_dst.shape)}")
    row = adj.row_index()
    logits = F.leaky_relu(a_src.index_select(0, adj.col) + a_dst.index_select(0, row), negative_slope)  # (E, H)
    peak = torch.zeros(n, heads, dtype=logits.dtype, device=logits.device).scatter_reduce(
        0, row.unsqueeze(1).expand(-1, heads), logits.detach(), reduce="amax", include_self=False)
    weight = torch.exp(logits - peak.index_select(0, row))
    total = torch.zeros(n, heads, dtype=logits.dtype, device=logits.device).index_add(0, row, weight)
    # every row with an edge has total >= 1 (its peak contributes exp(0)); (H, E) so each head is contiguous
    alpha = dropout((weight / total.index_select(0, row)).t().contiguous(), attention_dropout, generator, True)
    # unbind (not indexing per head): its backward stacks the per-head gradients in one allocation
    outs = [spmm(adj.with_values(alpha_k), h_k) for alpha_k, h_k in zip(alpha.unbind(0), h.unbind(1))]
    return torch.stack(outs, dim=1) if outs else h.new_zeros(n, 0, h.shape[2])
