"""Strategies whose partitions train in isolation (no halo traffic while training).

``tma`` (RandomTMA / SuperTMA, time-based model aggregation): every worker trains the whole model
on its own partition only (cross-partition edges dropped), and the models are averaged, weighted by
train-node counts, every ``agg_every_steps`` steps or every ``agg_every_seconds`` seconds
(``model_sync``). With ``random`` partitions this is RandomTMA, with ``supernode`` partitions
SuperTMA. With ``tolerate_failures`` a worker that dies is dropped from the average: the survivors
form a new process group through the launcher and training completes.

``grappa`` (gradient-only communication): partitions train in isolation and exchange only
gradients, every step (``grad_sync``). Every ``grappa_refresh_every`` epochs the partitioning is
refreshed (the same method with the next seed, each refresh a partition artefact in the store) to
expose new neighbourhoods. Gradients are combined with the coverage-corrected estimator

    g = sum_p sum_{v in T_p} w_v * grad l_v(theta; G_p) / sum_p sum_{v in T_p} w_v,
    w_v = (1 - lambda) * c_v + lambda,      c_v = d_v(G_p) / d_v(G),

where T_p are partition p's train nodes, G_p its local graph, d_v the in-degree without self loops
(c_v = 1 when d_v(G) = 0): a node whose neighbourhood the partition sees only in part gives a
biased gradient and counts less. lambda = ``grappa_shrinkage`` shrinks the weights towards uniform
(0 = pure coverage correction, 1 = plain averaging). Without missing edges every c_v = 1 and the
estimator is the plain train-count-weighted average of the partitions' mean gradients, i.e. the
centralized gradient.

Both evaluate on validation every aggregation point / ``eval_every`` epochs on their local graphs
(counts summed, ``control``). The final evaluation runs the model on the full graph (the halo setup
protocol and one forward with halo exchange, counted at epoch -1), or, if a tma worker was dropped,
on the surviving partitions' local graphs.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from retexo_core.comm.communicator import Communicator, CommunicationError
from retexo_core.config import TrainConfig
from retexo_core.data import PartData
from retexo_core.device import CPU
from retexo_core.exchange import exchange_rows, stack_rows
from retexo_core.halo import VIEWS, VIEW_LEVEL, in_degree, node_levels
from retexo_core.models import Features, LocalGraph, local_graph
from retexo_core.results import ResultSink
from retexo_core.strategies.common import (
    adam,
    BestState,
    WorkerContext,
    make_context,
    split_stats,
    sync_gradients,
    val_hits,
    validate,
)
from retexo_core.link import isolated_link_index, link_loss
from retexo_core.strategies.endtoend import EndToEndResult, forward, link_rows, new_model, new_optimizer
from retexo_core.strategies.link import link_stats_of

T = TypeVar("T")
log = logging.getLogger("retexo.train")


def isolated_context(comm: Communicator, data: PartData, config: TrainConfig, device: torch.device = CPU
                     ) -> WorkerContext:
    """A context with only the partition's own edges (src owned) and no halo: no setup traffic.
    The graphs are built in host memory, then the data and the graphs move to ``device``."""
    data = data.to(CPU)
    n = data.num_owned
    own = data.src < n
    level = node_levels(data).numpy()
    graphs = {}
    for view in VIEWS:
        visible = level <= VIEW_LEVEL[view]
        keep = own.copy()
        keep[own] = visible[data.src[own]] & visible[data.dst[own]]
        degree = torch.from_numpy(in_degree(n + data.num_halo, data.src, data.dst, keep))
        graphs[view] = local_graph(config.model, data.src, data.dst, degree, n, keep=keep)
    if config.setting == "transductive":
        graphs = dict.fromkeys(VIEWS, graphs["full"])
    local_train = int(data.masks["train"].sum())
    link = isolated_link_index(data) if config.task == "link" else None
    return WorkerContext(comm, data, config, None, local_train, graphs, {}, link=link).on(device)  # type: ignore[arg-type]


def local_outputs(blocks: nn.ModuleList, x: Features, graph: LocalGraph,
                  gen: torch.Generator | None = None) -> list[torch.Tensor]:
    """Every block's outputs on a local graph without halo rows."""
    outputs, h = [], x
    for block in blocks:
        h = block(h, graph, gen)
        outputs.append(h)
    return outputs


def local_forward(blocks: nn.ModuleList, x: Features, graph: LocalGraph,
                  gen: torch.Generator | None = None) -> torch.Tensor:
    return local_outputs(blocks, x, graph, gen)[-1]


def coverage_weights(local_degree: np.ndarray, global_degree: np.ndarray, shrinkage: float) -> np.ndarray:
    """Grappa's node weights w_v = (1 - lambda) * c_v + lambda with c_v = d_v(G_p) / d_v(G)."""
    coverage = np.divide(local_degree, global_degree, out=np.ones_like(local_degree, dtype=np.float64),
                         where=global_degree > 0)
    return (1.0 - shrinkage) * coverage + shrinkage


class Tolerant:
    """Runs the collectives of a strategy that may lose ranks (tma with ``tolerate_failures``).

    After a failure the survivors re-form the group (``Communicator.rejoin``) and agree on the
    newest operation any of them was in (one exchange of an 8-byte count, control). An operation
    cannot complete on one rank while another never takes part, so a survivor is at most one
    operation ahead: it completed the operation that failed elsewhere (some peers' data reached it
    before the dead rank's did not reach them). The survivors behind skip their operation
    (``skipped()``: e.g. no averaging this time) and the ones at the newest redo it together.
    """

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.index = 0  # operations started so far

    def __call__(self, operation: Callable[[], T], skipped: Callable[[], T]) -> T:
        self.index += 1
        while True:
            try:
                return operation()
            except CommunicationError:
                if not self.ctx.config.tolerate_failures:
                    raise
                newest = self.rejoin_and_agree()
                log.warning("lost a rank; %d survivors re-formed the group at operation %d%s", self.ctx.comm.world,
                            newest, " (this rank skips its operation)" if self.index < newest else "")
                if self.index < newest:
                    return skipped()

    def rejoin_and_agree(self) -> int:
        """Re-form the group with the survivors; the newest operation index among them."""
        comm = self.ctx.comm
        while True:
            comm.rejoin()
            try:
                return max(comm.exchange_counts([self.index] * comm.world))
            except CommunicationError:
                continue  # another rank was lost meanwhile


def train_tma(ctx: WorkerContext) -> EndToEndResult:
    cfg, comm, data = ctx.config, ctx.comm, ctx.data
    blocks = new_model(ctx)
    gen = ctx.generator()
    optimizer = new_optimizer(cfg, blocks)
    mask, best = data.masks["train"], BestState()
    weight = ctx.local_train if ctx.link is None else len(ctx.link.train_src)  # of this part's model in the average
    tolerant = Tolerant(ctx)
    started = last_aggregation = time.monotonic()
    comm.layer = 0
    for epoch in range(cfg.epochs):
        comm.epoch = epoch
        blocks.train()
        optimizer.zero_grad()
        logits = local_forward(blocks, data.x, ctx.graphs["train"], gen)
        if ctx.link is not None:  # task link: this part's own edges, mean over them
            link_loss(logits, ctx.link, data.num_owned, gen).backward()
        else:
            (F.cross_entropy(logits[mask], data.y[mask], reduction="sum") / max(ctx.local_train, 1)).backward()
        optimizer.step()
        if cfg.agg_every_seconds is None:
            due = (epoch + 1) % cfg.agg_every_steps == 0
        else:  # every rank must agree: one flag per step (control)
            flag = torch.tensor([float(time.monotonic() - last_aggregation >= cfg.agg_every_seconds)], dtype=torch.float64)
            due = bool(tolerant(lambda: comm.all_reduce(flag, "control"), lambda: torch.zeros(1))[0] > 0)
        if not due and epoch != cfg.epochs - 1:
            continue
        last_aggregation = time.monotonic()
        if comm.world > 1:
            tolerant(lambda: average_by_train_count(comm, blocks, weight), lambda: None)
        stats = split_stats if ctx.link is None else lambda _, emb: link_stats_of(ctx)(emb)
        validate(ctx, blocks, 0, epoch, cfg.epochs, lambda: local_forward(blocks, data.x, ctx.graphs["val"]), best,
                 lambda logits: tolerant(lambda: stats(ctx, logits), lambda: None))
    best.restore(blocks)
    return EndToEndResult(blocks, {}, best.round, best.accuracy, cfg.epochs, time.monotonic() - started,
                          val_hits=best.hits)


def average_by_train_count(comm: Communicator, module: nn.Module, count: int) -> None:
    """Parameters <- sum_p n_p theta_p / sum_p n_p, in one all-reduce of (parameters, n_p), so the
    weights stay right whoever takes part (model_sync)."""
    with torch.no_grad():
        params = list(module.parameters())
        flat = torch.cat([p.reshape(-1) for p in params] + [torch.ones(1, device=params[0].device)]) * float(count)
        total = comm.all_reduce(flat, "model_sync")
        weight = float(total[-1])
        offset = 0
        for p in params:
            p.copy_(total[offset:offset + p.numel()].reshape(p.shape) / max(weight, 1e-12))
            offset += p.numel()


def grappa_weights(ctx: WorkerContext) -> torch.Tensor:
    """(n,) w_v of this partition's nodes for the current partitioning (train view)."""
    data = ctx.data
    n = data.num_owned
    own = data.src < n
    global_degree = in_degree(n, data.src, data.dst)
    local_degree = in_degree(n, data.src[own], data.dst[own])
    weights = coverage_weights(local_degree, global_degree, ctx.config.grappa_shrinkage)
    return torch.from_numpy(weights).float().to(ctx.device)


def grappa_weights_and_total(ctx: WorkerContext) -> tuple[torch.Tensor, float]:
    """((n,) w_v, the sum of w over every rank's train nodes) (one all-reduce of the local sum, control)."""
    weights = grappa_weights(ctx)
    local = torch.tensor([float(weights[ctx.data.masks["train"]].sum())], dtype=torch.float64)
    total = ctx.comm.all_reduce(local, "control")
    return weights, max(float(total[0]), 1e-12)


def grappa_loss(ctx: WorkerContext, blocks: nn.ModuleList, weights: torch.Tensor, total: float,
                gen: torch.Generator | None = None) -> torch.Tensor:
    """This rank's share of Grappa's objective, sum over its train nodes of w_v l_v(theta; G_p) over
    the global weight total; the gradient all-reduce sums the shares into the estimator."""
    data, mask = ctx.data, ctx.data.masks["train"]
    logits = local_forward(blocks, data.x, ctx.graphs["train"], gen)
    return (F.cross_entropy(logits[mask], data.y[mask], reduction="none") * weights[mask]).sum() / total


def train_grappa(ctx: WorkerContext, load_refresh: Callable[[int], PartData]) -> EndToEndResult:
    """``load_refresh(period)``: this rank's part of the partitioning of refresh period 1, 2, ..."""
    cfg, comm = ctx.config, ctx.comm
    blocks = new_model(ctx)
    gen = ctx.generator()
    optimizer = new_optimizer(cfg, blocks)
    best = BestState()
    comm.layer = 0
    started = time.monotonic()
    for epoch in range(cfg.epochs):
        comm.epoch = epoch
        if epoch % cfg.grappa_refresh_every == 0:
            period = epoch // cfg.grappa_refresh_every
            if period > 0:
                refreshed = isolated_context(comm, load_refresh(period), cfg, ctx.device)
                refreshed.history = ctx.history
                ctx = refreshed
            weights, total = grappa_weights_and_total(ctx)
        data = ctx.data
        blocks.train()
        optimizer.zero_grad()
        grappa_loss(ctx, blocks, weights, total, gen).backward()
        sync_gradients(comm, blocks)
        optimizer.step()
        if (epoch + 1) % cfg.eval_every and epoch != cfg.epochs - 1:
            continue
        validate(ctx, blocks, 0, epoch, cfg.epochs, lambda: local_forward(blocks, data.x, ctx.graphs["val"]), best)
    best.restore(blocks)
    # no val_hits: two recipe candidates' best epochs may fall in different refresh periods, whose
    # partitions give a rank other validation nodes; the search judges both on the full graph
    # (``full_graph_validation``)
    return EndToEndResult(blocks, {}, best.round, best.accuracy, cfg.epochs, time.monotonic() - started)


def evaluate_outputs(ctx: WorkerContext, blocks: nn.ModuleList) -> tuple[WorkerContext, dict[str, list[torch.Tensor]]]:
    """Per-view, per-layer outputs for the final evaluation: on the full graph (setup protocol and
    halo exchange, epoch -1) when every partition is present, else on the local graphs."""
    comm, data = ctx.comm, ctx.data
    comm.epoch = -1
    blocks.eval()
    if comm.world < data.num_parts:
        with torch.no_grad():
            computed = {v: local_outputs(blocks, data.x, ctx.graphs[v]) for v in ctx.views}
        return ctx, {v: computed.get(v, computed["full"]) for v in VIEWS}
    comm.layer = 1
    full = make_context(comm, data, ctx.config, ctx.device)
    x_local = stack_rows(data.x, exchange_rows(comm, full.plans["full"], data.x, "halo_features"))
    with torch.no_grad():
        computed = {v: forward(full, blocks, x_local, full.graphs[v], full.plans[v]) for v in full.views}
    return full, {v: computed.get(v, computed["full"]) for v in VIEWS}


def evaluated(ctx: WorkerContext, result: EndToEndResult) -> tuple[WorkerContext, EndToEndResult]:
    """``result`` with the outputs of the final evaluation (``evaluate_outputs``) and its context."""
    eval_ctx, result.outputs = evaluate_outputs(ctx, result.blocks)
    eval_ctx.history = ctx.history
    if eval_ctx.link is not None:
        with torch.no_grad():
            result.link_embeddings = link_rows(eval_ctx, result.outputs["full"][-1])
    return eval_ctx, result


def full_graph_validation(eval_ctx: WorkerContext, result: EndToEndResult) -> tuple[float, torch.Tensor | None]:
    """The validation score of an ``evaluated`` model on the full graph (its context ``eval_ctx``)
    and its ``common.val_hits`` there (None for ROC-AUC): what the recipe search compares these
    strategies' candidates by, since their training validates on the local graphs only, whose
    figure can rank two candidates the other way round. One all-reduce (control)."""
    if result.link_embeddings is not None:
        return link_stats_of(eval_ctx)(result.link_embeddings)["val"].score, None
    logits = result.outputs["val"][-1]
    return split_stats(eval_ctx, logits)["val"].score, val_hits(eval_ctx, logits)


def train_tma_model(ctx: WorkerContext, sink: ResultSink, load_refresh: Callable[[int], PartData]
                    ) -> tuple[WorkerContext, EndToEndResult]:
    """The registry's trainer of tma (not warm-startable: ``sink`` holds no initial state)."""
    return evaluated(ctx, train_tma(ctx))


def train_grappa_model(ctx: WorkerContext, sink: ResultSink, load_refresh: Callable[[int], PartData]
                       ) -> tuple[WorkerContext, EndToEndResult]:
    """The registry's trainer of grappa, over the partitions of ``load_refresh``."""
    return evaluated(ctx, train_grappa(ctx, load_refresh))
