"""Retexo lazy message passing: train one layer at a time, one halo exchange per layer.

Per layer l on every rank: (1) one halo exchange of the layer's inputs (raw features for l = 1,
layer l-1 embeddings after that; inductive runs exchange each view's embeddings of the nodes
visible in that view); (2) GCN and SAGE aggregate those frozen inputs once (Â·X, or the neighbour
mean next to the node's own row), GAT keeps its inputs and propagates every round; (3) R_l rounds
of training of ``block_l + head`` on the train nodes (dropout on the aggregates), with gradient sync
every round (``sync=grad``) or local steps with model averaging every ``sync_every`` rounds
(``sync=avg``), validating every ``eval_every`` rounds on the val view; (4) the parameters with the
best validation accuracy are kept; (5) the owned nodes' outputs in every view become the next
layer's inputs (and, for the last layer, the predictions). No graph work happens inside the round
loop except GAT's attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retexo_core.exchange import exchange_rows, stack_rows
from retexo_core.models import Aggregated, Block, Features, LayerWithHead, layer_dims, seeded
from retexo_core.strategies.common import (
    adam,
    BestState,
    WorkerContext,
    average_parameters,
    sync_gradients,
    validate,
)

Views = dict[str, Features]  # view name -> (rows, d) inputs (all names present; shared when transductive)


@dataclass
class LayerResult:
    module: LayerWithHead
    outputs: dict[str, torch.Tensor]  # (n, d_out) owned outputs per view (logits for the last layer)
    best_round: int
    best_val: float


def gather_inputs(ctx: WorkerContext, layer: int, own: Views) -> Views:
    """The layer's single halo exchange (per view in the inductive setting, for layers > 1).

    Raw features are graph-independent, so layer 1 exchanges them once, with the full plan; the
    train and val views never read the rows of nodes they do not contain (no edges reach them).
    """
    kind = "halo_features" if layer == 1 else "halo_embeddings"
    ctx.comm.layer, ctx.comm.epoch = layer, -1
    views = ("full",) if layer == 1 else ctx.views
    local = {v: stack_rows(own[v], exchange_rows(ctx.comm, ctx.plans[v], own[v], kind)) for v in views}
    return {v: local.get(v, local["full"]) for v in own}


def new_layer(ctx: WorkerContext, layer: int, in_dim: int) -> LayerWithHead:
    """Layer ``layer`` with identical initial parameters on every rank."""
    cfg = ctx.config
    _, out_dim = layer_dims(in_dim, cfg.hidden, ctx.data.num_classes, cfg.layers)[layer - 1]
    with seeded(cfg.seed * 1000 + layer):
        block = Block(cfg.model, in_dim, out_dim, cfg.heads, cfg.dropout, last=(layer == cfg.layers))
        return LayerWithHead(block, ctx.data.num_classes)


def chunks(total: int, size: int | None) -> list[torch.Tensor]:
    """Positions 0..total-1 in consecutive chunks of ``size`` (one chunk when ``size`` is None)."""
    if size is None or size >= total:
        return [torch.arange(total)]
    return list(torch.arange(total).split(size))


class LayerInputs:
    """A layer's frozen inputs, prepared once for the rows each phase needs.

    GCN / SAGE: aggregated once per view (``Block.aggregate``); the train rows and the evaluation
    rows are selected once, and a mini-batch takes its rows from them (exact: no sampling, no
    extra traffic). GAT: the inputs stay as they are, and a batch of target rows propagates over
    their in-edges only (the graph restricted to them). Evaluation and the layer's outputs are
    computed in chunks of ``chunk`` rows, so that memory stays bounded by the batch size.
    """

    def __init__(self, ctx: WorkerContext, block: Block, inputs: Views, chunk: int | None = None):
        self.block, self.chunk = block, chunk
        self.frozen = block.model != "gat"
        self.train_rows, self.eval_rows = ctx.train_rows, ctx.eval_rows
        views = {v: v if v in ctx.views else "full" for v in inputs}
        self.inputs, self.graphs = inputs, ctx.graphs
        if self.frozen:
            distinct = {v: block.aggregate(inputs[v], ctx.graphs[v]) for v in ctx.views}
            self.aggregated: dict[str, Aggregated] = {v: distinct[views[v]] for v in inputs}
            self.train = self.aggregated["train"].rows(self.train_rows)
            self.val = self.aggregated["val"].rows(self.eval_rows)
        else:
            self.train_graph = ctx.graphs["train"].restrict(self.train_rows)

    def train_outputs(self, gen: torch.Generator, batch: torch.Tensor | None = None) -> torch.Tensor:
        """(b, d_out) block outputs of the train rows ``batch`` (positions among the train rows;
        all of them when None), train view."""
        if self.frozen:
            return self.block.from_aggregated(self.train if batch is None else self.train.rows(batch), gen)
        graph = self.train_graph if batch is None else self.graphs["train"].restrict(self.train_rows[batch])
        return self.block(self.inputs["train"], graph, gen)

    def val_outputs(self) -> torch.Tensor:
        """(e, d_out) block outputs of the evaluation rows (val view), in chunks."""
        if self.frozen:
            return torch.cat([self.block.from_aggregated(self.val.rows(c)) for c in chunks(len(self.eval_rows), self.chunk)])
        graph = self.graphs["val"]
        return torch.cat([self.block(self.inputs["val"], graph.restrict(self.eval_rows[c]))
                          for c in chunks(len(self.eval_rows), self.chunk)])

    def outputs(self, view: str) -> torch.Tensor:
        """(n, d_out) block outputs of every owned node in ``view``, in chunks."""
        graph = self.graphs[view]
        parts = chunks(graph.num_owned, self.chunk)
        if self.frozen:
            if len(parts) == 1:
                return self.block.from_aggregated(self.aggregated[view])
            return torch.cat([self.block.from_aggregated(self.aggregated[view].rows(c)) for c in parts])
        if len(parts) == 1:
            return self.block(self.inputs[view], graph)
        return torch.cat([self.block(self.inputs[view], graph.restrict(c)) for c in parts])


class BatchPlan:
    """The steps of one round: this rank's train rows in batches of ``batch_size``.

    Gradient sync (``sync=grad``) needs every rank to take the same number of steps: the ranks'
    train counts are exchanged once per layer (8 B to each peer, control), every rank takes
    max(ceil(count / batch_size)) steps (a rank out of rows contributes nothing to the later
    ones), and each step's loss is the sum over the rows of every rank's batch in that step,
    divided by their total (the gradient of the mean over that step's union). Local steps
    (``sync=avg``) need no agreement. Without ``batch_size``, or when one batch holds every rank's
    rows, a round is one full-batch step, exactly as without mini-batches.
    """

    def __init__(self, ctx: WorkerContext, batch_size: int | None):
        cfg = ctx.config
        local = ctx.local_train
        if batch_size is None:
            counts = None
            self.steps = 1
        elif cfg.sync == "grad":
            counts = ctx.comm.exchange_counts([local] * ctx.comm.world)
            self.steps = max(1, max(-(-c // batch_size) for c in counts))
        else:
            counts = [local]
            self.steps = max(1, -(-local // batch_size))
        self.local, self.batch_size = local, batch_size
        if self.steps == 1:
            self.totals = [ctx.train_count if cfg.sync == "grad" else local]
        elif cfg.sync == "grad":
            self.totals = [sum(min(batch_size, max(c - s * batch_size, 0)) for c in counts)  # type: ignore[union-attr]
                           for s in range(self.steps)]
        else:
            self.totals = [min(batch_size, local - s * batch_size) for s in range(self.steps)]  # type: ignore[operator]

    def round(self, gen: torch.Generator) -> list[tuple[torch.Tensor | None, int]]:
        """[(batch positions among the train rows, or None for all of them; the step's divisor)]."""
        if self.steps == 1:
            return [(None, max(self.totals[0], 1))]
        order = torch.randperm(self.local, generator=gen)
        batches = list(order.split(self.batch_size))  # type: ignore[arg-type]
        batches += [order[:0]] * (self.steps - len(batches))
        return [(batch, max(total, 1)) for batch, total in zip(batches, self.totals)]


def train_layer(ctx: WorkerContext, layer: int, inputs: Views) -> LayerResult:
    cfg, comm = ctx.config, ctx.comm
    module = new_layer(ctx, layer, inputs["full"].shape[1])
    gen = ctx.generator(layer)  # per-rank dropout masks
    optimizer = adam(module, cfg.layer_lr(layer), cfg.weight_decay)
    rounds = cfg.layer_rounds(layer)
    best = BestState()
    share = ctx.local_train / max(ctx.train_count, 1)
    train_rows = ctx.train_rows
    comm.layer, comm.epoch = layer, -1
    prepared = LayerInputs(ctx, module.block, inputs, cfg.batch_size)
    steps = BatchPlan(ctx, cfg.batch_size)
    for round_ in range(rounds):
        comm.epoch = round_
        module.train()
        for batch, divisor in steps.round(gen):
            optimizer.zero_grad()
            logits = module.logits(prepared.train_outputs(gen, batch), gen)
            labels = ctx.data.y[train_rows if batch is None else train_rows[batch]]
            (F.cross_entropy(logits, labels, reduction="sum") / divisor).backward()
            if cfg.sync == "grad":
                sync_gradients(comm, module)
            optimizer.step()
        last = round_ == rounds - 1
        synced = cfg.sync == "grad" or (round_ + 1) % cfg.sync_every == 0 or last
        if not synced:
            continue
        if cfg.sync == "avg":
            average_parameters(comm, module, share)
        if (round_ + 1) % cfg.eval_every and not last:
            continue
        validate(ctx, module, layer, round_, rounds, lambda: module.logits(prepared.val_outputs()), best,
                 rows=prepared.eval_rows)
    best.restore(module)
    module.eval()
    with torch.no_grad():
        computed = {v: prepared.outputs(v) for v in ctx.views}
    return LayerResult(module, {v: computed.get(v, computed["full"]) for v in inputs}, best.round, best.accuracy)
