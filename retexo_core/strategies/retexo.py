"""Retexo lazy message passing: train one layer at a time, one halo exchange per layer.

Per layer l on every rank: (1) one halo exchange of the layer's inputs (raw features for l = 1,
layer l-1 embeddings after that; inductive runs exchange each view's embeddings of the nodes
visible in that view); (2) GCN and SAGE aggregate those frozen inputs once (Â·X, or the neighbour
mean next to the node's own row), peer by peer as the halo rows arrive, so that a worker never
holds all of its halo's rows; GAT keeps its inputs and propagates every round; (3) R_l rounds
of training of ``block_l + head`` (the last layer: ``block_L``, which starts as layer L-1's head on
the node's own row where it has a skip connection, ``models.start_from_head``) on the train nodes
(dropout on the aggregates), with gradient sync
every round (``sync=grad``) or local steps with model averaging every ``sync_every`` rounds
(``sync=avg``; ``drift_correction``: ``common.DriftCorrection``), validating every ``eval_every``
rounds on the val view; (4) the parameters with the best validation accuracy are kept; (5) the
owned nodes' outputs in every view become the next layer's inputs (and, for the last layer, the
predictions). No graph work happens inside the round
loop except GAT's attention.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from retexo_core.config import TrainConfig
from retexo_core.data import normalize_rows
from retexo_core.device import CPU
from retexo_core.exchange import exchange_rows, stack_rows, stream_rows
from retexo_core.models import (
    AGGREGATED_DENSITY,
    Aggregated,
    Block,
    Features,
    HeadState,
    LayerWithHead,
    layer_dims,
    partial_aggregate,
    seeded,
    start_from_head,
)
from retexo_core.recipe import apply_knobs, search_for
from retexo_core.strategies.joint import HIDDEN_PREFIX
from retexo_core.sparse import SparseMatrix
from retexo_core.strategies.common import (
    adam,
    BestState,
    DriftCorrection,
    WorkerContext,
    average_parameters,
    paired_counts,
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
    rounds: int  # rounds trained (fewer than configured after early stopping)
    recipe: dict[str, object]  # the candidate chosen on validation and every candidate's score (empty: no search)
    loop_rounds: int = 0  # rounds all the layer's candidates trained
    loop_seconds: float = 0.0  # their round loops' seconds (validation included; no exchange, aggregation, outputs)
    link_embeddings: torch.Tensor | None = None  # task link, last layer: (rows, link_dim) of every row this rank embeds
    kept: "LayerFit | None" = None  # the kept candidate's training (its configuration and prepared inputs)
    joint_hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # layer L-1 trained on with the last (joint.py)


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


def place_rows(rows: Features, positions: np.ndarray, size: int) -> Features:
    """(r, d) rows at ``positions`` of a (size, d) block (the rest zero); the rows themselves when
    they fill the block in order."""
    if len(positions) == size and np.array_equal(positions, np.arange(size)):
        return rows
    index = torch.from_numpy(positions).to(rows.device)
    if isinstance(rows, SparseMatrix):
        return SparseMatrix.from_coo(index[rows.row_index()], rows.col, rows.val, (size, rows.shape[1]))
    placed = rows.new_zeros((size, rows.shape[1]))
    placed[index] = rows
    return placed


def add_aggregates(total: Features, part: Features) -> Features:
    """Sum of two partial aggregates (sparse while both are)."""
    if isinstance(total, SparseMatrix) and isinstance(part, SparseMatrix):
        return SparseMatrix.from_scipy(total.to_scipy() + part.to_scipy()).to(total.device)
    dense = [x.to_dense() if isinstance(x, SparseMatrix) else x for x in (total, part)]
    return dense[0] + dense[1]


def stored_aggregate(neigh: Features) -> Features:
    """A sparse aggregate denser than ``AGGREGATED_DENSITY`` is kept dense."""
    if isinstance(neigh, SparseMatrix) and neigh.density > AGGREGATED_DENSITY:
        return neigh.to_dense()
    return neigh


Transform = Callable[[Features], Features]  # a row-wise preprocessing of a layer's inputs


def streamed_aggregates(ctx: WorkerContext, layer: int, own: Views, transforms: Sequence[Transform] = (lambda x: x,),
                        keep_own: bool = False) -> list[dict[str, Aggregated]]:
    """GCN / SAGE: the layer's single halo exchange and its aggregation A·t(X) per view and per
    row-wise transform t (one list entry each), peer by peer.

    A·X = A[:, own] @ X_own + sum over peers j of A[:, halo of j] @ X_j: each peer's rows are
    aggregated as soon as they arrive and then dropped. Layer 1 exchanges the raw features once
    (the full plan) and every view aggregates them with its own graph; later layers exchange each
    view's rows of the nodes visible in it. A row-wise transform (row normalisation) of the rows a
    peer sends equals the peer's transform of its own rows, so every transform shares the exchange.
    The owned rows themselves are kept next to the aggregate for SAGE and with ``keep_own`` (a
    GCN block with a skip connection).
    """
    comm, n = ctx.comm, ctx.data.num_owned
    comm.layer, comm.epoch = layer, -1
    kind = "halo_features" if layer == 1 else "halo_embeddings"
    readers = {"full": list(ctx.views)} if layer == 1 else {v: [v] for v in ctx.views}
    blocks = ctx.plan.halo_blocks()  # type: ignore[union-attr]
    neigh: list[dict[str, Features]] = [{} for _ in transforms]
    for source, views in readers.items():
        adj = {v: ctx.graphs[v].adj for v in views}
        for t, transform in enumerate(transforms):
            mine = transform(own[source] if layer == 1 else own[views[0]])
            for v in views:
                neigh[t][v] = partial_aggregate(adj[v].columns(0, n), mine)
        plan = ctx.plans[source]
        for peer, rows in stream_rows(comm, plan, own[source], kind):
            block = blocks[peer]
            for t, transform in enumerate(transforms):
                placed = place_rows(transform(rows), plan.recv_index[peer] - block.start, block.stop - block.start)
                for v in views:
                    part = partial_aggregate(adj[v].columns(n + block.start, n + block.stop), placed)
                    neigh[t][v] = add_aggregates(neigh[t][v], part)
    keep_own = keep_own or ctx.config.model == "sage"
    result = []
    for t, transform in enumerate(transforms):
        distinct = {v: Aggregated(stored_aggregate(neigh[t][v]), transform(own[v]) if keep_own else None)
                    for v in ctx.views}
        result.append({v: distinct[v if v in distinct else "full"] for v in own})
    return result


def new_layer(ctx: WorkerContext, layer: int, in_dim: int) -> LayerWithHead:
    """Layer ``layer`` with identical initial parameters on every rank (drawn on the CPU, then
    moved to the rank's device)."""
    cfg = ctx.config
    _, out_dim = layer_dims(in_dim, cfg.hidden, ctx.output_width, cfg.layers)[layer - 1]
    with seeded(cfg.seed * 1000 + layer):
        block = Block(cfg.model, in_dim, out_dim, cfg.heads, cfg.dropout, last=(layer == cfg.layers), norm=cfg.uses_norm,
                      skip=cfg.skip, attention_dropout=cfg.attention_dropout)
        return LayerWithHead(block, ctx.output_width).to(ctx.device)


def chunks(total: int, size: int | None, device: torch.device) -> list[torch.Tensor]:
    """Positions 0..total-1 on ``device`` in consecutive chunks of ``size`` (one chunk when ``size`` is None)."""
    if size is None or size >= total:
        return [torch.arange(total, device=device)]
    return list(torch.arange(total, device=device).split(size))


class LayerInputs:
    """A layer's frozen inputs, prepared once for the rows each phase needs.

    GCN / SAGE (``aggregated``): the aggregates per view; the train rows and the evaluation rows
    are selected once, and a mini-batch takes its rows from them (exact: no sampling, no extra
    traffic). GAT (``inputs``): the local inputs stay as they are, and a batch of target rows
    propagates over their in-edges only (the graph restricted to them). Evaluation and the layer's
    outputs are computed in chunks of ``chunk`` rows, so that memory stays bounded by the batch size.
    """

    def __init__(self, ctx: WorkerContext, block: Block | None, *, aggregated: dict[str, Aggregated] | None = None,
                 inputs: Views | None = None, chunk: int | None = None):
        self.block, self.chunk, self.device = block, chunk, ctx.device
        self.frozen = aggregated is not None
        self.train_rows, self.eval_rows = ctx.train_rows, ctx.eval_rows
        self.inputs, self.graphs = inputs, ctx.graphs
        if aggregated is not None:
            self.aggregated = aggregated
            self.train = aggregated["train"].rows(self.train_rows)
            self.val = aggregated["val"].rows(self.eval_rows)
        else:
            self.train_graph = ctx.graphs["train"].restrict(self.train_rows)

    @classmethod
    def exchanged(cls, ctx: WorkerContext, layer: int, model: str, own: Views,
                  transforms: Sequence[Transform], keep_own: bool = False) -> list["LayerInputs"]:
        """The layer's single halo exchange and its preparation for each row-wise input transform:
        streamed aggregates (GCN / SAGE) or the local inputs with their halo rows (GAT). Each
        result's ``block`` is set by the candidate that trains on it."""
        chunk = ctx.config.batch_size
        if model == "gat":
            local = gather_inputs(ctx, layer, own)
            return [cls(ctx, None, inputs={v: t(x) for v, x in local.items()}, chunk=chunk) for t in transforms]
        return [cls(ctx, None, aggregated=a, chunk=chunk)
                for a in streamed_aggregates(ctx, layer, own, transforms, keep_own)]

    def train_outputs(self, gen: torch.Generator, batch: torch.Tensor | None = None) -> torch.Tensor:
        """(b, d_out) block outputs of the train rows ``batch`` (positions among the train rows;
        all of them when None), train view."""
        if self.frozen:
            return self.block.from_aggregated(self.train if batch is None else self.train.rows(batch), gen)
        graph = self.train_graph if batch is None else self.graphs["train"].restrict(self.train_rows[batch])
        return self.block(self.inputs["train"], graph, gen)  # type: ignore[index]

    def val_outputs(self) -> torch.Tensor:
        """(e, d_out) block outputs of the evaluation rows (val view), in chunks."""
        parts = chunks(len(self.eval_rows), self.chunk, self.device)
        if self.frozen:
            if len(parts) == 1:
                return self.block.from_aggregated(self.val)
            return torch.cat([self.block.from_aggregated(self.val.rows(c)) for c in parts])
        graph = self.graphs["val"]
        return torch.cat([self.block(self.inputs["val"], graph.restrict(self.eval_rows[c])) for c in parts])

    def outputs(self, view: str) -> torch.Tensor:
        """(n, d_out) block outputs of every owned node in ``view``, in chunks."""
        graph = self.graphs[view]
        parts = chunks(graph.num_owned, self.chunk, self.device)
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

    def round(self, gen: torch.Generator, device: torch.device) -> list[tuple[torch.Tensor | None, int]]:
        """[(batch positions among the train rows on ``device``, or None for all of them; the
        step's divisor)]; the order is drawn from ``gen``, wherever it is."""
        if self.steps == 1:
            return [(None, max(self.totals[0], 1))]
        order = torch.randperm(self.local, generator=gen, device=gen.device).to(device)
        batches = list(order.split(self.batch_size))  # type: ignore[arg-type]
        batches += [order[:0]] * (self.steps - len(batches))
        return [(batch, max(total, 1)) for batch, total in zip(batches, self.totals)]


def features_transform(config: TrainConfig, knobs: dict[str, object]) -> Transform:
    """The row-wise input transform of a recipe's ``features`` knob (none when ``config`` has
    normalised the features already: ``--normalize-features rows``)."""
    if knobs.get("features") == "rows" and config.normalize_features != "rows":
        return normalize_rows
    return lambda x: x


class LayerFit:
    """The training of one layer module on its prepared inputs, resumable: ``advance(r)`` trains
    up to round r (fewer with patience), validating every ``eval_every`` rounds, at the layer's
    last round and at r; ``best`` keeps the parameters with the best validation score."""

    def __init__(self, ctx: WorkerContext, layer: int, module: LayerWithHead, prepared: LayerInputs):
        cfg = ctx.config
        self.ctx, self.layer, self.module, self.prepared = ctx, layer, module, prepared
        self.gen = ctx.generator(layer)  # per-rank dropout masks (the same stream for every candidate)
        # batches: from the same stream on the CPU; from a host stream with the same seed on a GPU,
        # so that a run without dropout takes the same batches on every device
        self.batches = self.gen if self.gen.device.type == "cpu" else ctx.generator(layer, CPU)
        self.optimizer = adam(module, cfg.layer_lr(layer), cfg.weight_decay if cfg.decays_layer(layer) else 0.0)
        self.rounds = cfg.layer_rounds(layer)
        self.best = BestState()
        self.share = ctx.local_train / max(ctx.train_count, 1)
        self.steps = BatchPlan(ctx, cfg.batch_size)
        self.train_rows = ctx.train_rows
        self.drift = (DriftCorrection(ctx.comm, module, self.share, lambda: self.loss(None, max(ctx.local_train, 1)))
                      if cfg.drift_correction else None)
        self.trained = 0
        self.stopped = False  # early stopping ended it
        self.seconds = 0.0  # spent in the round loop (validation included)
        self.history: list[dict[str, object]] = []  # its validation rows (ctx.history while it trains)

    def advance(self, until: int) -> None:
        ctx, cfg, module = self.ctx, self.ctx.config, self.module
        comm = ctx.comm
        until = min(until, self.rounds)
        outer, ctx.history = ctx.history, self.history
        started = time.perf_counter()
        try:
            for round_ in range(self.trained, until):
                if self.stopped:
                    break
                self.trained = round_ + 1
                comm.epoch = round_
                module.train()
                if self.drift is not None:
                    self.drift.before_round()
                for batch, divisor in self.steps.round(self.batches, ctx.device):
                    self.optimizer.zero_grad()
                    self.loss(batch, divisor).backward()
                    if cfg.sync == "grad":
                        sync_gradients(comm, module)
                    elif self.drift is not None:
                        self.drift.apply()
                    self.optimizer.step()
                last = round_ == self.rounds - 1
                pause = round_ == until - 1
                synced = cfg.sync == "grad" or (round_ + 1) % cfg.sync_every == 0 or last or pause
                if not synced:
                    continue
                if cfg.sync == "avg":
                    average_parameters(comm, module, self.share)
                    if self.drift is not None:
                        self.drift.averaged()
                if (round_ + 1) % cfg.eval_every and not last and not pause:
                    continue
                self.validate(round_)
                self.stopped = self.best.stale(round_, cfg.patience)
        finally:
            ctx.history = outer
            self.seconds += time.perf_counter() - started

    def loss(self, batch: torch.Tensor | None, divisor: int) -> torch.Tensor:
        """The step's loss: cross-entropy of the train rows ``batch`` (all when None), summed, / ``divisor``."""
        rows = self.train_rows if batch is None else self.train_rows[batch]
        logits = self.module.logits(self.prepared.train_outputs(self.gen, batch), self.gen)
        return F.cross_entropy(logits, self.ctx.data.y[rows], reduction="sum") / divisor

    def validate(self, round_: int) -> None:
        """One model-selection point on the evaluation rows (``common.validate``)."""
        validate(self.ctx, self.module, self.layer, round_, self.rounds,
                 lambda: self.module.logits(self.prepared.val_outputs()), self.best, rows=self.prepared.eval_rows)

    def link_embeddings(self) -> torch.Tensor | None:
        """The link task's embeddings of every row this rank embeds, by the module as it is (None here)."""
        return None

    def finish(self) -> BestState:
        self.advance(self.rounds)
        self.best.restore(self.module)
        return self.best


def train_layer(ctx: WorkerContext, layer: int, own: Views, initial: dict[str, torch.Tensor] | None = None,
                kinds: tuple[type[LayerInputs], type[LayerFit]] = (LayerInputs, LayerFit),
                previous_head: HeadState | None = None) -> LayerResult:
    """Layer ``layer`` from this rank's own inputs ``own`` (its halo exchange included), starting
    from the parameters ``initial`` when given (warm start; with 0 rounds they are kept as they are),
    else, for the last layer, from ``previous_head`` (the previous layer's auxiliary head:
    ``models.start_from_head``) where its candidate has a skip connection (GCN, GAT).

    The layer's recipe candidates (``recipe.search_for``) all train from the same initial parameters
    on inputs prepared from the same single halo exchange (one preparation per ``features``
    value). The start recipe trains ``screen_rounds`` rounds, then each alternative as many; an
    alternative that beats the kept one on validation by the search's margin
    (``GreedySearch.replaces``, from one all-reduce of 2 counts) replaces it, and the kept one
    finally goes on to the layer's full rounds. Every candidate's traffic is logged; the kept
    one's history is stored.
    ``kinds``: the classes that prepare the inputs and train a candidate (the link task's, for it)."""
    base = ctx.config
    search = search_for(base, layer, end_to_end=False, nonnegative=ctx.data.features_nonnegative)
    features = list(dict.fromkeys([search.best.knobs["features"]]
                                  + [v for n, v in search.plan if n == "features"]))
    skips = bool(search.best.knobs["skip"]) or any(n == "skip" for n, _ in search.plan)
    inputs_kind, fit_kind = kinds
    prepared = dict(zip(features, inputs_kind.exchanged(ctx, layer, base.model, own,
                                                          [features_transform(base, {"features": f}) for f in features],
                                                          keep_own=skips)))
    screen = base.screen_rounds if search.size > 1 else base.layer_rounds(layer)
    total = base.layer_rounds(layer) + (search.size - 1) * min(screen, base.layer_rounds(layer))
    if layer == base.layers and base.trains_jointly:
        # the last two layers' rounds together follow (stages.with_last_two_together), twice with the fresh pair
        total += base.last_two_rounds * (2 if base.joint_fresh else 1)
    spent = 0
    kept: LayerFit | None = None
    fits = []
    while (candidate := search.next()) is not None:
        fit = start_fit(ctx, layer, own, initial, candidate.knobs, prepared[candidate.knobs["features"]], fit_kind,
                        previous_head)
        fits.append(fit)
        fit.ctx.progress = (spent, total)
        fit.advance(screen)
        spent += fit.trained
        paired = None if kept is None else paired_counts(ctx.comm, fit.best.hits, kept.best.hits)
        if search.report(fit.best.accuracy, paired):
            kept = fit
    assert kept is not None
    kept.ctx.progress = (spent - kept.trained, total)
    best = kept.finish()
    ctx.history += kept.history
    module, inputs = kept.module, kept.prepared
    module.eval()
    with torch.no_grad():
        computed = {v: inputs.outputs(v) for v in ctx.views}
        embeddings = kept.link_embeddings() if layer == base.layers else None
    return LayerResult(module, {v: computed.get(v, computed["full"]) for v in own}, best.round, best.accuracy,
                       kept.trained, search.choice(), sum(f.trained for f in fits), sum(f.seconds for f in fits), embeddings,
                       kept)


def start_fit(ctx: WorkerContext, layer: int, own: Views, initial: dict[str, torch.Tensor] | None,
              knobs: dict[str, object], inputs: LayerInputs, fit_kind: type[LayerFit] = LayerFit,
              previous_head: HeadState | None = None) -> LayerFit:
    """A candidate's module (the layer's initial parameters, or for the last layer the previous
    layer's head where it fits) on its own copy of the prepared inputs."""
    mine = dataclasses.replace(ctx, config=apply_knobs(ctx.config, layer, knobs, end_to_end=False))
    module = new_layer(mine, layer, own["full"].shape[1])
    if initial is not None:
        module.load_state_dict({k: v for k, v in initial.items() if not k.startswith(HIDDEN_PREFIX)})
    elif previous_head is not None and module.head is None:
        start_from_head(module.block, previous_head)
    prepared = copy.copy(inputs)
    prepared.block = module.block
    return fit_kind(mine, layer, module, prepared)
