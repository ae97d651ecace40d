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

from retexo_core.exchange import exchange_rows, stack_rows
from retexo_core.models import Aggregated, Block, Features, LayerWithHead, layer_dims, seeded
from retexo_core.strategies.common import (
    adam,
    BestState,
    WorkerContext,
    average_parameters,
    sync_gradients,
    train_loss,
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


class LayerInputs:
    """A layer's frozen inputs, prepared once for the rows each phase needs.

    GCN / SAGE: aggregated once per view (``Block.aggregate``); the train rows and the evaluation
    rows are selected once. GAT: the inputs stay as they are, and the graphs are restricted once to
    the in-edges of the train rows and of the evaluation rows, over which GAT propagates per call.
    """

    def __init__(self, ctx: WorkerContext, block: Block, inputs: Views):
        self.block = block
        self.frozen = block.model != "gat"
        views = {v: v if v in ctx.views else "full" for v in inputs}
        if self.frozen:
            distinct = {v: block.aggregate(inputs[v], ctx.graphs[v]) for v in ctx.views}
            self.aggregated: dict[str, Aggregated] = {v: distinct[views[v]] for v in inputs}
            self.train = self.aggregated["train"].rows(ctx.train_rows)
            self.val = self.aggregated["val"].rows(ctx.eval_rows)
        else:
            self.inputs, self.graphs = inputs, ctx.graphs
            self.train_graph = ctx.graphs["train"].restrict(ctx.train_rows)
            self.val_graph = ctx.graphs["val"].restrict(ctx.eval_rows)

    def train_outputs(self, gen: torch.Generator) -> torch.Tensor:
        """(t, d_out) block outputs of the train rows (train view)."""
        if self.frozen:
            return self.block.from_aggregated(self.train, gen)
        return self.block(self.inputs["train"], self.train_graph, gen)

    def val_outputs(self) -> torch.Tensor:
        """(e, d_out) block outputs of the evaluation rows (val view)."""
        if self.frozen:
            return self.block.from_aggregated(self.val)
        return self.block(self.inputs["val"], self.val_graph)

    def outputs(self, view: str) -> torch.Tensor:
        """(n, d_out) block outputs of every owned node in ``view``."""
        if self.frozen:
            return self.block.from_aggregated(self.aggregated[view])
        return self.block(self.inputs[view], self.graphs[view])


def train_layer(ctx: WorkerContext, layer: int, inputs: Views) -> LayerResult:
    cfg, comm = ctx.config, ctx.comm
    module = new_layer(ctx, layer, inputs["full"].shape[1])
    gen = ctx.generator(layer)  # per-rank dropout masks
    optimizer = adam(module, cfg.layer_lr(layer), cfg.weight_decay)
    rounds = cfg.layer_rounds(layer)
    best = BestState()
    share = ctx.local_train / max(ctx.train_count, 1)
    train_rows, eval_rows = ctx.train_rows, ctx.eval_rows
    comm.layer = layer
    prepared = LayerInputs(ctx, module.block, inputs)
    for round_ in range(rounds):
        comm.epoch = round_
        module.train()
        optimizer.zero_grad()
        logits = module.logits(prepared.train_outputs(gen), gen)
        train_loss(ctx, logits, global_mean=(cfg.sync == "grad"), rows=train_rows).backward()
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
                 rows=eval_rows)
    best.restore(module)
    module.eval()
    with torch.no_grad():
        computed = {v: prepared.outputs(v) for v in ctx.views}
    return LayerResult(module, {v: computed.get(v, computed["full"]) for v in inputs}, best.round, best.accuracy)
