"""Exchange plans over a halo (full, visible-only, BNS-sampled), the exchange of planned rows (dense,
or sparse bag-of-words rows in a sparse encoding), and the differentiable halo exchange (``halo_rows``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from retexo_core.comm.communicator import Communicator
from retexo_core.comm.sparse_codec import decode_rows, encode_rows
from retexo_core.device import CPU, to_host
from retexo_core.halo import HaloPlan
from retexo_core.models import Features
from retexo_core.sparse import SparseMatrix


@dataclass
class ExchangePlan:
    """Which owned rows go to which rank, and where received rows land in the halo.

    send_index[j]: (m_j,) owned positions sent to rank j.
    recv_index[j]: (r_j,) halo positions (0-based) filled by rank j, in the order j sends them.
    num_halo: h.
    """

    send_index: list[np.ndarray]
    recv_index: list[np.ndarray]
    num_halo: int


def full_plan(plan: HaloPlan) -> ExchangePlan:
    recv = [np.arange(s.start, s.stop) for s in plan.halo_blocks()]
    return ExchangePlan(plan.send_index, recv, int(sum(plan.recv_counts)))


def view_plan(plan: HaloPlan, num_owned: int, view: str) -> ExchangePlan:
    """Only rows of nodes present in ``view`` (inductive setting); both sides know the levels."""
    visible = plan.visible(view)
    owned_visible, halo_visible = visible[:num_owned], visible[num_owned:]
    send = [idx[owned_visible[idx]] for idx in plan.send_index]
    recv = [np.arange(s.start, s.stop)[halo_visible[s]] for s in plan.halo_blocks()]
    return ExchangePlan(send, recv, int(sum(plan.recv_counts)))


def sampled_plan(comm: Communicator, base: ExchangePlan, rate: float, rng: np.random.Generator) -> ExchangePlan:
    """BNS-GCN: each owner keeps ``int(rate * m_j)`` random rows for rank j and tells j which ones
    (their positions within j's request list, 8 B each, kind ``control``)."""
    chosen = [np.sort(rng.choice(len(idx), int(rate * len(idx)), replace=False)) for idx in base.send_index]
    counts = [int(rate * len(idx)) for idx in base.recv_index]
    got = comm.exchange([torch.from_numpy(c) for c in chosen], [(c,) for c in counts], torch.int64, "control")
    send = [idx[c] for idx, c in zip(base.send_index, chosen)]
    recv = [idx[got[j].numpy()] if j != comm.rank else idx[:0] for j, idx in enumerate(base.recv_index)]
    return ExchangePlan(send, recv, base.num_halo)


def exchange_rows(comm: Communicator, plan: ExchangePlan, owned: Features, kind: str) -> Features:
    """Send planned rows of ``owned`` (n, d); return (h, d) halo rows (zeros where nothing arrives)."""
    if isinstance(owned, SparseMatrix):
        return exchange_sparse_rows(comm, plan, owned, kind)
    send = [owned[torch.from_numpy(idx).to(owned.device)] for idx in plan.send_index]
    return received_halo(comm, plan, send, owned.dtype, kind)


def received_halo(comm: Communicator, plan: ExchangePlan, send: list[torch.Tensor], dtype: torch.dtype,
                  kind: str) -> torch.Tensor:
    """Send ``send[j]`` (the (m_j, d) rows rank j needs) to every rank; returns the (h, d) halo
    rows, each peer's at its ``recv_index`` (zeros where nothing arrives), on the rows' device."""
    width = send[0].shape[1]
    got = comm.exchange(send, [(len(idx), width) for idx in plan.recv_index], dtype, kind)
    halo = send[0].new_zeros((plan.num_halo, width))
    for j, idx in enumerate(plan.recv_index):
        if j != comm.rank and len(idx):
            halo[torch.from_numpy(idx).to(halo.device)] = got[j]
    return halo


def exchange_sparse_rows(comm: Communicator, plan: ExchangePlan, owned: SparseMatrix, kind: str) -> SparseMatrix:
    """Sparse rows travel as (nnz per row, column ids, values) with the run's compression of values;
    the payload sizes go first (``control``). Returns the (h, d) sparse halo rows, on ``owned``'s
    device (they are encoded and decoded in host memory)."""
    codec = comm.codec(kind)
    host = owned.to(CPU) if comm.world > 1 else owned
    payloads = [encode_rows(host.select_rows(torch.from_numpy(idx)), codec) if j != comm.rank
                else torch.empty(0, dtype=torch.uint8) for j, idx in enumerate(plan.send_index)]
    got = comm.exchange_bytes(payloads, kind)
    rows, cols, vals = [], [], []
    for j, idx in enumerate(plan.recv_index):
        if j == comm.rank or not len(idx):
            continue
        block = decode_rows(got[j], len(idx), owned.shape[1], codec)
        rows.append(torch.from_numpy(idx)[block.row_index()])
        cols.append(block.col)
        vals.append(block.val)
    if not rows:
        return SparseMatrix.from_coo(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32),
                                     (plan.num_halo, owned.shape[1])).to(owned.device)
    return SparseMatrix.from_coo(torch.cat(rows), torch.cat(cols), torch.cat(vals),
                                 (plan.num_halo, owned.shape[1])).to(owned.device)


def stream_rows(comm: Communicator, plan: ExchangePlan, owned: Features, kind: str) -> Iterator[tuple[int, Features]]:
    """The planned rows of ``owned``, one peer at a time: in step s = 1..K-1 every rank sends its
    rows for rank + s and receives those of rank - s (one exchange each), and the step yields
    (that peer, its (len(recv_index[peer]), d) rows, on ``owned``'s device). Only one peer's rows
    are in memory at once; the bytes are those of ``exchange_rows`` (sparse rows: their size, 8 B,
    as control first; encoded and decoded in host memory)."""
    world, rank = comm.world, comm.rank
    host = owned.to(CPU) if isinstance(owned, SparseMatrix) else owned

    def only(value: object, j: int) -> list:
        return [value if k == j else None for k in range(world)]

    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        rows = torch.from_numpy(plan.send_index[dst]).to(owned.device)
        expected = len(plan.recv_index[src])
        if isinstance(owned, SparseMatrix):
            codec = comm.codec(kind)
            payload = encode_rows(host.select_rows(rows), codec)
            size = comm.exchange(only(torch.tensor([payload.numel()]), dst), only((1,), src), torch.int64, "control")
            got = comm.exchange(only(payload, dst), only((int(size[src][0]),), src), torch.uint8, kind)
            yield src, decode_rows(got[src], expected, owned.shape[1], codec).to(owned.device)
        else:
            got = comm.exchange(only(owned[rows], dst), only((expected, owned.shape[1]), src), owned.dtype, kind)
            yield src, got[src]


def stack_rows(top: Features, bottom: Features) -> Features:
    """(a, d) over (b, d) -> (a + b, d): the owned rows followed by the halo rows."""
    if not isinstance(top, SparseMatrix):
        return torch.cat([top, bottom])  # type: ignore[list-item]
    low = bottom.row_index() + top.shape[0]  # type: ignore[union-attr]
    return SparseMatrix.from_coo(torch.cat([top.row_index(), low]), torch.cat([top.col, bottom.col]),  # type: ignore[union-attr]
                                 torch.cat([top.val, bottom.val]), (top.shape[0] + bottom.shape[0], top.shape[1]))  # type: ignore[union-attr]


def halo_rows(comm: Communicator, plan: ExchangePlan, owned: torch.Tensor, layer: int) -> torch.Tensor:
    """(h, d) halo rows of the owned activations ``owned`` (n, d) (kind ``halo_embeddings``),
    differentiable: in the backward pass the halo gradients go back to their owners, where
    autograd sums them into ``owned``'s gradient (kind ``halo_grads``).

    The rows sent are gathered on ``owned``'s device and the exchange itself (``HaloExchange``)
    works on host tensors, as the communicator sends them anyway. So its backward runs in the
    thread that called ``backward()``: autograd runs a GPU node on the device's own worker thread,
    which ranks run as threads of one process share, and a collective there would wait for peers
    queued behind it."""
    index = torch.from_numpy(np.concatenate(plan.send_index)).to(owned.device)
    return HaloExchange.apply(to_host(owned[index]), comm, plan, layer).to(owned.device)


class HaloExchange(torch.autograd.Function):
    """Forward: the (sum of m_j, d) host rows the peers need, in peer order (``send_index``) ->
    the (h, d) halo rows (kind ``halo_embeddings``). Backward: the halo gradients go back to their
    owners (kind ``halo_grads``) and arrive as the gradient of the rows sent."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, comm: Communicator, plan: ExchangePlan, layer: int) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.plan, ctx.layer = comm, plan, layer
        comm.layer = layer
        send = list(torch.split(sent.detach(), [len(idx) for idx in plan.send_index]))
        return received_halo(comm, plan, send, sent.dtype, "halo_embeddings")

    @staticmethod
    def backward(ctx, grad_halo: torch.Tensor):  # type: ignore[override]
        comm, plan = ctx.comm, ctx.plan
        comm.layer = ctx.layer
        send = [grad_halo[torch.from_numpy(idx)] for idx in plan.recv_index]
        shapes = [(len(idx), grad_halo.shape[1]) for idx in plan.send_index]
        got = comm.exchange(send, shapes, grad_halo.dtype, "halo_grads")
        grads = [got[j] if j != comm.rank else grad_halo.new_zeros(shape) for j, shape in enumerate(shapes)]
        return torch.cat(grads), None, None, None
