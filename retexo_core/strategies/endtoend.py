"""End-to-end training of the whole model over partitions: ``standard`` (with BNS-GCN sampling)
and ``varco``.

Every epoch each block's owned activations are sent to the ranks that hold them as halo nodes
(``halo_embeddings``) and the gradients of those halo activations come back in the backward pass
(``halo_grads``); raw features are exchanged once and cached (``halo_features``); gradients are
summed by an all-reduce (``grad_sync``). With ``bns_rate`` p < 1 each owner sends only a
random fraction p of the rows each peer needs (BNS-GCN); edges from unsampled halo nodes are
dropped for that epoch and the sampled rows weigh 1/p, as in BNS-GCN, so that each aggregation is
an unbiased estimate of the full one (GCN and SAGE keep the full graph's normalisation).
``varco`` (Cervino et al.) caches the raw features exactly as ``standard`` does and compresses
what ``standard`` sends every epoch: the boundary activations (and so their gradients) of the
hidden layers, by a ratio that moves from ``c_max`` to ``c_min`` over training (see
``varco_plans``). Validation forwards (every
``eval_every`` epochs, on the val view) are counted too. With one rank this is exactly
centralized full-graph training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from retexo_core.config import TrainConfig
from retexo_core.data import PartData
from retexo_core.exchange import ExchangePlan, exchange_rows, halo_rows, sampled_plan, stack_rows
from retexo_core.link import link_loss
from retexo_core.models import Features, LocalGraph, build_blocks
from retexo_core.results import ResultSink
from retexo_core.strategies.common import BestState, adam, WorkerContext, sync_gradients, train_loss, validate
from retexo_core.strategies.link import link_stats_of


@dataclass
class EndToEndResult:
    blocks: nn.ModuleList
    outputs: dict[str, list[torch.Tensor]]  # view -> per layer (n, d_l) owned outputs of the best model
    best_round: int
    best_val: float
    epochs: int  # epochs trained (fewer than configured after early stopping)
    loop_seconds: float = 0.0  # spent in the epoch loop (validation included)
    link_embeddings: torch.Tensor | None = None  # task link: (rows, link_dim) of every row this rank embeds
    val_hits: torch.Tensor | None = None  # the best model's ``common.val_hits`` at its validation


def forward(ctx: WorkerContext, blocks: nn.ModuleList, x_local: Features, graph: LocalGraph,
            plan: ExchangePlan | list[ExchangePlan], gen: torch.Generator | None = None) -> list[torch.Tensor]:
    """Owned outputs of every block; between blocks the halo rows travel through the communicator
    (``plan`` for every exchange, or one plan per exchange: inputs of layers 2..L)."""
    plans = plan if isinstance(plan, list) else [plan] * (len(blocks) - 1)
    outputs, h = [], x_local
    for k, block in enumerate(blocks):
        out = block(h, graph, gen)
        outputs.append(out)
        if k < len(blocks) - 1:
            h = torch.cat([out, halo_rows(ctx.comm, plans[k], out, k + 2)])
    return outputs


def link_rows(ctx: WorkerContext, out: torch.Tensor) -> torch.Tensor:
    """Task link: the owned embeddings (n, d) followed by the remote rows this rank scores pairs
    with (``LinkIndex``), which their owners send every epoch (kind ``halo_embeddings``; their
    gradients go back as ``halo_grads``); the owned embeddings alone for the node task or one rank."""
    if ctx.link is None or ctx.comm.world == 1 or ctx.plan is None:  # no plan: parts that train alone
        return out
    return torch.cat([out, halo_rows(ctx.comm, ctx.link.plan, out, ctx.config.layers + 1)])


def varco_ratio(epoch: int, epochs: int, c_max: float, c_min: float, schedule: str) -> float:
    """VARCO's compression ratio at ``epoch``: ``c_max`` throughout (``fixed``), or moving linearly
    from ``c_max`` at the first epoch to ``c_min`` at the last (``linear``)."""
    if schedule == "fixed" or epochs == 1:
        return c_max
    return c_max - (c_max - c_min) * epoch / (epochs - 1)


def varco_plans(ctx: WorkerContext, epoch: int, rng: np.random.Generator) -> list[ExchangePlan]:
    """This epoch's plans of the exchanges between blocks (inputs of layers 2..L): compressed by
    ratio c (each owner sends a random 1/c of the rows each peer needs, the rest arrive as zeros, as
    SAR's node compressor does; their gradients travel back for the same rows only). One sample per
    epoch, shared by the layers. The paper leaves the last layer's inputs uncompressed; with two
    layers that would leave nothing to compress, so then they are compressed too (our deviation)."""
    cfg = ctx.config
    ratio = varco_ratio(epoch, cfg.epochs, cfg.varco_c_max, cfg.varco_c_min, cfg.varco_schedule)
    ctx.comm.layer = 0
    compressed = sampled_plan(ctx.comm, ctx.plans["train"], 1.0 / ratio, rng)
    if cfg.layers == 2:
        return [compressed]
    return [compressed] * (cfg.layers - 2) + [ctx.plans["train"]]


def sampled_graph(ctx: WorkerContext, plan: ExchangePlan) -> LocalGraph:
    """Train-view graph of a BNS-GCN epoch: edges from halo nodes that received nothing this epoch
    dropped, and the rows that did arrive from peer j weighted by (rows requested from j) / (rows
    received from j), BNS-GCN's 1/rate (see ``LocalGraph.reweighted_sources``)."""
    n = ctx.data.num_owned
    scale = torch.zeros(n + ctx.data.num_halo, device=ctx.device)
    scale[:n] = 1.0
    for requested, got in zip(ctx.plans["train"].recv_index, plan.recv_index):
        if len(got):
            scale[n + torch.from_numpy(got).to(ctx.device)] = len(requested) / len(got)
    return ctx.graphs["train"].reweighted_sources(scale)


def new_model(ctx: WorkerContext) -> nn.ModuleList:
    cfg = ctx.config
    return build_blocks(cfg.model, ctx.data.x.shape[1], cfg.hidden, ctx.output_width, cfg.layers, cfg.heads,
                        cfg.dropout, cfg.seed * 1000, norm=cfg.uses_norm, skip=cfg.skip,
                        attention_dropout=cfg.attention_dropout).to(ctx.device)


def new_optimizer(cfg: TrainConfig, blocks: nn.ModuleList) -> torch.optim.Adam:
    """Adam with the weight decay on the blocks of the layers ``cfg.decays_layer`` names (the
    same rule as layer-wise training)."""
    decayed = nn.ModuleList(b for k, b in enumerate(blocks, start=1) if cfg.decays_layer(k))
    return adam(blocks, cfg.layer_lr(1), cfg.weight_decay, decayed)


def train_end_to_end(ctx: WorkerContext, initial: list[dict[str, torch.Tensor]] | None = None) -> EndToEndResult:
    """Train the whole model (standard, BNS, VARCO, centralized), from the blocks' parameters
    ``initial`` when given (warm start; with 0 epochs they are evaluated as they are)."""
    cfg, comm, data = ctx.config, ctx.comm, ctx.data
    blocks = new_model(ctx)
    for block, state in zip(blocks, initial or []):
        block.load_state_dict(state)
    gen = ctx.generator()
    rng = np.random.default_rng([cfg.seed, comm.rank])
    comm.layer, comm.epoch = 1, -1
    # raw features once, cached; views that lack a node have no edge from it
    x_local = stack_rows(data.x, exchange_rows(comm, ctx.plans["full"], data.x, "halo_features"))
    optimizer = new_optimizer(cfg, blocks)
    best = BestState()
    trained = 0
    started = time.perf_counter()
    for epoch in range(cfg.epochs):
        trained = epoch + 1
        comm.epoch = epoch
        plan: ExchangePlan | list[ExchangePlan] = ctx.plans["train"]
        graph = ctx.graphs["train"]
        if cfg.strategy == "varco":
            plan = varco_plans(ctx, epoch, rng)
        elif cfg.bns_rate < 1:
            comm.layer = 0
            plan = sampled_plan(comm, ctx.plans["train"], cfg.bns_rate, rng)
            graph = sampled_graph(ctx, plan)
        blocks.train()
        optimizer.zero_grad()
        outputs = forward(ctx, blocks, x_local, graph, plan, gen)
        if ctx.link is not None:  # task link
            link_loss(link_rows(ctx, outputs[-1]), ctx.link, data.num_owned, gen).backward()
        else:
            train_loss(ctx, outputs[-1], global_mean=True).backward()
        comm.layer = 0
        sync_gradients(comm, blocks)
        optimizer.step()
        if (epoch + 1) % cfg.eval_every and epoch != cfg.epochs - 1:
            continue
        validate(ctx, blocks, 0, epoch, cfg.epochs,
                 lambda: link_rows(ctx, forward(ctx, blocks, x_local, ctx.graphs["val"], ctx.plans["val"])[-1]), best,
                 stats_of=None if ctx.link is None else link_stats_of(ctx))
        if best.stale(epoch, cfg.patience):
            break
    seconds = time.perf_counter() - started
    best.restore(blocks)
    blocks.eval()
    comm.epoch = -1
    with torch.no_grad():
        computed = {v: forward(ctx, blocks, x_local, ctx.graphs[v], ctx.plans[v]) for v in ctx.views}
        outputs = {v: computed.get(v, computed["full"]) for v in ("train", "val", "full")}
        embeddings = None if ctx.link is None else link_rows(ctx, outputs["full"][-1])
    return EndToEndResult(blocks, outputs, best.round, best.accuracy, trained, seconds, embeddings, best.hits)


def train_model(ctx: WorkerContext, sink: ResultSink, load_refresh: Callable[[int], PartData]
                ) -> tuple[WorkerContext, EndToEndResult]:
    """The registry's trainer (standard, BNS, VARCO, centralized): from the warm-start run's blocks
    when ``sink`` has them; evaluated in ``ctx`` itself."""
    initial = [sink.initial_state(layer) for layer in range(1, ctx.config.layers + 1)]
    return ctx, train_end_to_end(ctx, None if initial[0] is None else initial)  # type: ignore[arg-type]
