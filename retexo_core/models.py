"""GNN blocks on sparse local graphs: GCN, GraphSAGE (mean) and GAT (multi-head).

A model is a stack of blocks ``conv -> ReLU`` (``conv -> LayerNorm -> ReLU`` with ``norm``) with a
last block ``conv -> classes``.
The convs' parameters have PyG's names and initialisation (``GCNConv``, ``SAGEConv`` with mean
aggregation, ``GATConv``: a state dict loads into PyG's conv, and the tests compare with it), but
workers do not import PyG; propagation is ours, by sparse matrix products on a *local graph*: rows
[0, n) are the owned (target) nodes, columns the sources (owned first, then halo nodes), so every
output row is exact. Inputs may be dense or sparse (bag-of-words features as a ``SparseMatrix``).

Two ways to run a block:

- end to end (``forward``): dropout on the block's input, then propagation, every step;
- layer-wise with frozen inputs (``partial_aggregate`` once per layer, see
  ``strategies.retexo.streamed_aggregates``, then ``from_aggregated`` every round): GCN's Â·X and
  SAGE's neighbour mean do not depend on the parameters, so they are computed once per layer and
  the rounds are dense (or sparse-times-dense) products on them. Here dropout acts on the
  aggregated inputs, after aggregation instead of before it. GAT's attention depends on its
  parameters, so GAT propagates in every round (``forward`` on the fixed inputs).

Per-layer (Retexo) training trains block l together with an auxiliary linear head
(hidden -> classes) that is used only while that layer trains; the last block starts as the last
hidden layer's head on the node's own row where it has a skip connection, its neighbour path at
zero (``start_from_head``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import math

import numpy as np
import torch
from torch import nn

from retexo_core.config import ModelName
from retexo_core.sparse import SparseMatrix, dropout, gat_aggregate, matmul, sparse_dropout, spmm, sparse_sparse

Features = torch.Tensor | SparseMatrix  # (rows, d) dense, or sparse bag-of-words
AGGREGATED_DENSITY = 0.25  # a sparse aggregate denser than this is stored dense
_INIT_LOCK = threading.Lock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build parameters from a fixed seed without disturbing the global RNG, also when several
    ranks run as threads of one process (torch's initialisers draw from the global RNG)."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def rows_of(x: Features, index: torch.Tensor | None) -> Features:
    """Rows ``index`` of dense or sparse features (all rows when ``index`` is None)."""
    if index is None:
        return x
    return x.select_rows(index) if isinstance(x, SparseMatrix) else x[index]


def first_rows(x: Features, n: int) -> Features:
    """Rows [0, n) (the owned nodes of local inputs)."""
    return x.select_rows(torch.arange(n)) if isinstance(x, SparseMatrix) else x[:n]


def aggregate_linear(adj: SparseMatrix, x: Features, weight: torch.Tensor) -> torch.Tensor:
    """adj @ x @ weight, multiplying in the cheaper order (sparse inputs are always transformed first)."""
    if isinstance(x, SparseMatrix) or x.shape[1] > weight.shape[1]:
        return spmm(adj, matmul(x, weight))
    return matmul(spmm(adj, x), weight)


@dataclass
class LocalGraph:
    """The local graph of one view.

    adj: (n, N) sparse, rows = owned targets, columns = sources (N = n + h, or n without halo):
        gcn: Â with one self loop per owned node, weights ``1 / sqrt((d_u + 1)(d_v + 1))`` from the
        *global* in-degrees (self loops ``1 / (d_v + 1)``), as PyG's ``gcn_norm`` on the whole graph;
        sage: the mean over the stored in-edges (``1 / in-degree`` of the target);
        gat: the stored edges without self loops plus one self loop per owned node, values 1.
    num_owned: n.
    model: the model the weights are for.
    targets: positions of the rows among the sources; None: 0..n-1.
    """

    adj: SparseMatrix
    num_owned: int
    model: ModelName
    targets: torch.Tensor | None = None

    def to(self, device: torch.device) -> "LocalGraph":
        """This graph on ``device`` (itself when it is there already)."""
        if self.adj.device == device:
            return self
        targets = None if self.targets is None else self.targets.to(device)
        return LocalGraph(self.adj.to(device), self.num_owned, self.model, targets)

    def restrict(self, rows: torch.Tensor) -> "LocalGraph":
        """The graph of the target rows ``rows`` only (their in-edges from the same sources)."""
        targets = rows if self.targets is None else self.targets[rows]
        return LocalGraph(self.adj.select_rows(rows), len(rows), self.model, targets)

    def own_rows(self, x: Features) -> Features:
        """The targets' own rows of local inputs ``x``."""
        return first_rows(x, self.num_owned) if self.targets is None else rows_of(x, self.targets)

    def reweighted_sources(self, scale: torch.Tensor) -> "LocalGraph":
        """BNS-GCN's graph of one epoch: every edge's weight multiplied by its source's ``scale``
        ((N,) float: 0 for halo nodes that sent nothing this epoch, 1/(fraction sent) for the rows
        a peer did send, 1 for owned nodes), so that A·X over the sampled rows is an unbiased
        estimate of A·X over all of them (GCN and SAGE keep the full graph's normalisation, as
        BNS-GCN's owners scale their sent rows by 1/rate). GAT's softmax must not see the dropped
        edges and renormalises over the rest, so its structure is rebuilt without them, unscaled."""
        adj = self.adj
        if self.model == "gat":
            kept = scale[adj.col] > 0
            rows = adj.row_index()[kept]
            return LocalGraph(SparseMatrix.from_coo(rows, adj.col[kept], None, adj.shape), self.num_owned,
                              self.model, self.targets)
        return LocalGraph(adj.with_values(adj.val * scale[adj.col].to(adj.val.dtype)), self.num_owned, self.model,
                          self.targets)


def local_graph(model: ModelName, src: np.ndarray, dst: np.ndarray, degree: torch.Tensor, num_owned: int,
                num_sources: int | None = None, keep: np.ndarray | None = None) -> LocalGraph:
    """The local graph of the edges ``src -> dst`` (local positions; only those in ``keep``).

    ``degree``: (N,) global in-degree without self loops (used by GCN only); ``num_sources``: N
    (default n: a graph without halo).
    """
    if keep is not None:
        src, dst = src[keep], dst[keep]
    shape = (num_owned, num_owned if num_sources is None else num_sources)
    if model == "sage":
        counts = np.bincount(dst, minlength=num_owned).astype(np.float32)
        weight = 1.0 / counts[dst]
        return LocalGraph(SparseMatrix.from_coo(dst, src, weight, shape), num_owned, model)
    no_loop = src != dst
    src, dst = src[no_loop], dst[no_loop]
    loops = np.arange(num_owned)
    rows, cols = np.concatenate([dst, loops]), np.concatenate([src, loops])
    if model == "gat":
        return LocalGraph(SparseMatrix.from_coo(rows, cols, np.ones(len(rows), np.float32), shape), num_owned, model)
    inv_sqrt = (degree.double() + 1.0).rsqrt().numpy()
    weight = np.concatenate([inv_sqrt[src] * inv_sqrt[dst], inv_sqrt[loops] ** 2]).astype(np.float32)
    return LocalGraph(SparseMatrix.from_coo(rows, cols, weight, shape), num_owned, model)


def glorot_(tensor: torch.Tensor) -> torch.Tensor:
    """PyG's ``glorot``: uniform in +-sqrt(6 / (fan_in + fan_out)) over the last two dimensions."""
    bound = math.sqrt(6.0 / (tensor.size(-2) + tensor.size(-1)))
    with torch.no_grad():
        return tensor.uniform_(-bound, bound)


def glorot_linear(in_dim: int, out_dim: int) -> nn.Linear:
    linear = nn.Linear(in_dim, out_dim, bias=False)
    glorot_(linear.weight)
    return linear


class GCNParams(nn.Module):
    """``GCNConv``'s parameters: ``lin`` (no bias, glorot) and ``bias`` (zeros)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.in_channels, self.out_channels = in_dim, out_dim
        self.lin = glorot_linear(in_dim, out_dim)
        self.bias = nn.Parameter(torch.zeros(out_dim))


class SAGEParams(nn.Module):
    """``SAGEConv``'s parameters: ``lin_l`` (neighbour mean, with bias) and ``lin_r`` (own row)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.in_channels, self.out_channels = in_dim, out_dim
        self.lin_l = nn.Linear(in_dim, out_dim)
        self.lin_r = nn.Linear(in_dim, out_dim, bias=False)


class GATParams(nn.Module):
    """``GATConv``'s parameters: ``lin`` (glorot), ``att_src`` / ``att_dst`` (1, H, C) (glorot),
    ``bias`` (zeros); heads concatenated (hidden layers) or averaged (last layer, one head)."""

    def __init__(self, in_dim: int, channels: int, heads: int, concat: bool, negative_slope: float = 0.2):
        super().__init__()
        self.in_channels, self.out_channels, self.heads, self.concat = in_dim, channels, heads, concat
        self.negative_slope = negative_slope
        self.lin = glorot_linear(in_dim, heads * channels)
        self.att_src = nn.Parameter(glorot_(torch.empty(1, heads, channels)))
        self.att_dst = nn.Parameter(glorot_(torch.empty(1, heads, channels)))
        self.bias = nn.Parameter(torch.zeros(heads * channels if concat else channels))


def make_conv(model: ModelName, in_dim: int, out_dim: int, heads: int, last: bool) -> nn.Module:
    """The parameters of ``model``'s conv from ``in_dim`` to ``out_dim`` features."""
    if model == "gcn":
        return GCNParams(in_dim, out_dim)
    if model == "sage":
        return SAGEParams(in_dim, out_dim)
    if last:
        return GATParams(in_dim, out_dim, heads=1, concat=False)
    if out_dim % heads:
        raise ValueError(f"GAT hidden size {out_dim} must be divisible by heads {heads}")
    return GATParams(in_dim, out_dim // heads, heads=heads, concat=True)


@dataclass
class Aggregated:
    """A layer's frozen, aggregated inputs of the owned nodes (computed once per layer).

    neigh: (n, d) GCN: Â·X; SAGE: the neighbour mean.
    own: (n, d) the node's own input row (SAGE, and GCN blocks with a skip connection); else None.
    """

    neigh: Features
    own: Features | None

    def rows(self, index: torch.Tensor | None) -> "Aggregated":
        return Aggregated(rows_of(self.neigh, index), None if self.own is None else rows_of(self.own, index))

    @property
    def num_rows(self) -> int:
        return self.neigh.shape[0]


def partial_aggregate(adj: SparseMatrix, x: Features) -> Features:
    """A·X for frozen inputs (no autograd): dense for dense X, sparse for sparse X."""
    if isinstance(x, SparseMatrix):
        return sparse_sparse(adj, x)
    with torch.no_grad():
        return spmm(adj, x)


def _drop(x: Features, p: float, gen: torch.Generator | None, training: bool) -> Features:
    if isinstance(x, SparseMatrix):
        return sparse_dropout(x, p, gen, training)
    return dropout(x, p, gen, training)


class Block(nn.Module):
    """``conv -> ReLU`` (hidden; ``conv -> LayerNorm -> ReLU`` with ``norm``) or ``conv`` (last layer);
    dropout rate ``dropout`` on the inputs (GAT: ``attention_dropout`` on the attention coefficients
    too). With ``skip`` (GCN, GAT) the conv's output gets a linear transform of
    the node's own input row added (``skip``: in -> out, no bias), as SAGE's root weight does: the
    node's own features are not mixed into its neighbours' (it needs no other rows)."""

    def __init__(self, model: ModelName, in_dim: int, out_dim: int, heads: int, dropout: float, last: bool,
                 norm: bool = False, skip: bool = False, attention_dropout: float = 0.0):
        super().__init__()
        self.model = model
        self.p = dropout
        self.attention_p = attention_dropout
        self.out_dim = out_dim
        self.last = last
        self.conv = make_conv(model, in_dim, out_dim, heads, last)
        self.norm = nn.LayerNorm(out_dim) if norm and not last else None
        self.skip = glorot_linear(in_dim, out_dim) if skip and model != "sage" else None

    # -- propagation -----------------------------------------------------------------------
    def propagate(self, x: Features, graph: LocalGraph, gen: torch.Generator | None = None) -> torch.Tensor:
        """(N, in) local inputs -> (n, out) conv outputs of the graph's target rows (before norm);
        ``gen`` draws GAT's attention dropout while training."""
        conv, adj, n = self.conv, graph.adj, graph.num_owned
        skip = 0.0 if self.skip is None else matmul(graph.own_rows(x), self.skip.weight.t())
        if self.model == "gcn":
            return aggregate_linear(adj, x, conv.lin.weight.t()) + conv.bias + skip
        if self.model == "sage":
            neigh = aggregate_linear(adj, x, conv.lin_l.weight.t())
            return neigh + conv.lin_l.bias + matmul(graph.own_rows(x), conv.lin_r.weight.t())
        heads, channels = conv.heads, conv.out_channels
        h = matmul(x, conv.lin.weight.t()).view(-1, heads, channels)
        a_src = (h * conv.att_src).sum(-1)
        a_dst = (graph.own_rows(h) * conv.att_dst).sum(-1)
        out = gat_aggregate(adj, h, a_src, a_dst, conv.negative_slope,
                            self.attention_p if self.training else 0.0, gen)
        out = out.reshape(n, heads * channels) if conv.concat else out.mean(dim=1)
        return out + conv.bias + skip

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.last:
            return out
        return torch.relu(out if self.norm is None else self.norm(out))

    def forward(self, x: Features, graph: LocalGraph, gen: torch.Generator | None = None) -> torch.Tensor:
        """(N, in) local inputs -> (n, out): dropout on the inputs, propagation, norm and ReLU."""
        return self.finish(self.propagate(_drop(x, self.p, gen, self.training), graph, gen))

    # -- layer-wise training on frozen inputs ---------------------------------------------
    def from_aggregated(self, agg: Aggregated, gen: torch.Generator | None = None) -> torch.Tensor:
        """(rows, out) outputs from aggregated inputs: dropout on the aggregates, then the dense part."""
        neigh = _drop(agg.neigh, self.p, gen, self.training)
        if self.model == "gcn":
            out = matmul(neigh, self.conv.lin.weight.t()) + self.conv.bias
            if self.skip is not None:
                out = out + matmul(_drop(agg.own, self.p, gen, self.training), self.skip.weight.t())  # type: ignore[arg-type]
            return self.finish(out)
        own = _drop(agg.own, self.p, gen, self.training)  # type: ignore[arg-type]
        lin_l, lin_r = self.conv.lin_l, self.conv.lin_r
        return self.finish(matmul(neigh, lin_l.weight.t()) + lin_l.bias + matmul(own, lin_r.weight.t()))


class LayerWithHead(nn.Module):
    """One block plus, for hidden layers, the auxiliary classifier used while training it alone."""

    def __init__(self, block: Block, num_classes: int):
        super().__init__()
        self.block = block
        self.head = None if block.last else nn.Linear(block.out_dim, num_classes)

    def logits(self, h: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """(rows, out) block outputs -> (rows, classes); the last layer's outputs are the logits."""
        return h if self.head is None else self.head(dropout(h, self.block.p, gen, self.training))


HeadState = dict[str, torch.Tensor]  # an auxiliary head's "weight" (classes, hidden) and "bias" (classes,)


def head_state(module: LayerWithHead) -> HeadState | None:
    """The auxiliary head's parameters of a hidden layer (None for the last layer)."""
    if module.head is None:
        return None
    return {"weight": module.head.weight.detach().clone(), "bias": module.head.bias.detach().clone()}


def start_from_head(block: Block, head: HeadState) -> bool:
    """Start a last GCN or GAT block that has a skip connection as the previous layer's auxiliary
    classifier: the skip (own-row) path takes the head's weight and the bias the head's bias, the
    neighbour path starts at zero, so that before its first round it predicts what the head
    predicted. False (the block unchanged) without a skip connection, and for SAGE: its root
    weight is always there, so the recipe search never compares this start with a fresh one, and
    on CiteSeer it lost (validation −0.4, test −1.7 points, layer-wise, 5 seeds)."""
    if block.skip is None:
        return False
    conv = block.conv
    with torch.no_grad():
        block.skip.weight.copy_(head["weight"])
        conv.lin.weight.zero_()
        conv.bias.copy_(head["bias"])
    return True


def layer_dims(in_dim: int, hidden: int, num_classes: int, layers: int) -> list[tuple[int, int]]:
    """(in, out) of each of ``layers`` blocks."""
    dims = [in_dim] + [hidden] * (layers - 1) + [num_classes]
    return list(zip(dims[:-1], dims[1:]))


def build_blocks(model: ModelName, in_dim: int, hidden: int, num_classes: int, layers: int, heads: int,
                 dropout: float, seed: int = 0, norm: bool = False, skip: bool = False,
                 attention_dropout: float = 0.0) -> nn.ModuleList:
    """The full model as a list of blocks (standard / centralized / varco / tma / grappa)."""
    dims = layer_dims(in_dim, hidden, num_classes, layers)
    with seeded(seed):
        return nn.ModuleList(
            Block(model, i, o, heads, dropout, last=(k == layers - 1), norm=norm, skip=skip,
                  attention_dropout=attention_dropout)
            for k, (i, o) in enumerate(dims)
        )
