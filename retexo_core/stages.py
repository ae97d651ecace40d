"""What one rank does in one launch: train the launch's layers and hand the results to the sink.

Layer-wise strategies (retexo, centralized layer-wise) train layer after layer in the same process
group: each layer's halo exchange, training, and its outputs written and committed before the next
layer starts from those outputs in memory. End-to-end strategies train the whole model once and
write every layer. The halo setup protocol runs once per launch. A rank computes on its device
(``retexo_core.device``); what it writes is moved to host memory first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch

from retexo_core.comm.communicator import Communicator
from retexo_core.config import TrainConfig
from retexo_core.data import SPLIT_NAMES, PartData, normalize_rows
from retexo_core.device import CPU, host_state, layer_fits, peak_memory_note, platform
from retexo_core.halo import VIEWS
from retexo_core.label_skew import LabelSkew, label_skew
from retexo_core.models import HeadState, head_state
from retexo_core.results import LayerSummary, ResultSink
from retexo_core.strategies.common import WorkerContext, final_evaluation, make_context, paired_counts
from retexo_core.strategies.endtoend import EndToEndResult
from retexo_core.strategies.isolated import full_graph_validation, isolated_context
from retexo_core.recipe import KNOB_NAMES, apply_knobs, search_for
from retexo_core.link import link_evaluation, pair_scores, recommendations
from retexo_core.strategies.link import LinkFit, LinkInputs
from retexo_core.strategies.joint import HiddenLayer, hidden_layer, hidden_of, train_last_two
from retexo_core.strategies.retexo import (
    LayerFit, LayerInputs, LayerResult, Views, features_transform, new_layer, train_layer,
)

log = logging.getLogger("retexo.worker")
HISTORY_SCHEMA = pa.schema([
    ("layer", pa.int64()), ("round", pa.int64()), ("split", pa.string()), ("loss", pa.float64()), ("acc", pa.float64()),
])


def train_stages(comm: Communicator, data: PartData, config: TrainConfig, layers: list[int], sink: ResultSink,
                 load_refresh: Callable[[int], PartData], device: torch.device = CPU) -> None:
    """Train ``layers`` (consecutive; all of them for end-to-end strategies) as this rank, on ``device``.

    ``load_refresh(period)``: grappa's partition of refresh period 1, 2, ... for this rank.
    """
    comm.layer = layers[0] if config.is_layerwise else 0
    data = prepare_features(data, config)
    config, skew = resolve_drift_correction(comm, data, config)
    context = isolated_context if config.strategy_spec.isolated else make_context
    ctx = context(comm, data, config, device)
    ctx.on_progress = lambda layer, done, total, val: sink.progress(layer, data.part, done, total, val,
                                                                    comm.log.total_bytes())
    log.info("%s %s on %s: %d owned nodes, %d halo nodes, %d edges, %d train nodes of %d; layers %s",
             config.strategy, config.model, device, data.num_owned, data.num_halo, len(data.src),
             ctx.local_train, ctx.train_count, layers)
    if config.is_layerwise:
        run_layerwise(ctx, layers, sink, skew)
        return
    run_end_to_end(ctx, layers, sink, lambda period: prepare_features(load_refresh(period), config))


def resolve_drift_correction(comm: Communicator, data: PartData, config: TrainConfig
                             ) -> tuple[TrainConfig, LabelSkew | None]:
    """``config`` with ``drift_correction`` decided where it is unset: under model averaging of
    the node task with several ranks, on where the ranks' train labels differ
    (``retexo_core.label_skew``, two small ``control`` all-reduces); off otherwise. Also the test
    it was decided on (None where nothing was tested)."""
    if config.drift_correction is not None:
        return config, None
    skew = None
    if config.strategy == "retexo" and config.sync == "avg" and config.task == "node" and comm.world > 1:
        train = data.masks["train"] & (data.y >= 0)
        skew = label_skew(comm, data.y[train], data.num_classes)
        log.info("drift correction %s: chi-square of rank against train label %.1f (df %d, p %.2g), Cramer's V %.3f",
                 "on, the ranks' train labels differ" if skew.differs else "off", skew.chi2, skew.df, skew.p_value,
                 skew.cramers_v)
    return config.model_copy(update={"drift_correction": bool(skew and skew.differs)}), skew


def prepare_features(data: PartData, config: TrainConfig) -> PartData:
    """The partition with its features row-normalised when ``config.normalize_features`` is rows
    (each rank its own rows; halo rows arrive preprocessed by their owner). ``auto`` keeps them raw:
    the choice is made on validation (``retexo_core.recipe``)."""
    return dataclasses.replace(data, x=normalize_rows(data.x)) if config.normalize_features == "rows" else data


def history_table(ctx: WorkerContext, layer: int | None) -> pa.Table:
    rows = [r for r in ctx.history if layer is None or r["layer"] == layer]
    return pa.Table.from_pylist(rows, schema=HISTORY_SCHEMA)


def own_inputs(ctx: WorkerContext, layer: int, sink: ResultSink) -> Views:
    """Inputs of ``layer`` for the owned nodes per view: raw features, or this rank's rows of the
    previous layer's outputs (``full``, and ``train`` / ``val`` when inductive)."""
    if layer == 1:
        return dict.fromkeys(VIEWS, ctx.data.x)
    views = sink.previous_outputs(layer - 1, ctx.data.part, ctx.data.node_id)
    full = torch.from_numpy(views["full"]).to(ctx.device)
    return {v: torch.from_numpy(views[v]).to(ctx.device) if v in views else full for v in VIEWS}


def stored_views(ctx: WorkerContext, outputs: dict[str, torch.Tensor]) -> dict[str, object]:
    """The views written for a layer (in host memory): the full view, plus train / val when inductive."""
    return {v: outputs[v].cpu().numpy() for v in (VIEWS if ctx.inductive else ("full",))}


def write_predictions(ctx: WorkerContext, logits: torch.Tensor, sink: ResultSink) -> None:
    """This rank's predictions from the last layer's full-view logits (n, C): class and max softmax."""
    probabilities = torch.softmax(logits.float(), dim=1)
    score, predicted = (t.cpu() for t in probabilities.max(dim=1))
    split = np.full(ctx.data.num_owned, "none", dtype=object)
    for name in SPLIT_NAMES:
        split[ctx.data.masks[name].cpu().numpy()] = name
    sink.write_predictions(ctx.data.part, ctx.data.node_id, predicted.numpy().astype(np.int64),
                           score.numpy().astype(np.float32), split)


def evaluate(ctx: WorkerContext, outputs: dict[str, torch.Tensor], embeddings: torch.Tensor | None
             ) -> list[dict[str, object]]:
    """The run's evaluation rows: per node split (``final_evaluation``), or per pair split (task
    link: ``embeddings`` of every row this rank embeds)."""
    if embeddings is None:
        return final_evaluation(ctx, outputs)
    assert ctx.link is not None and ctx.data.pairs is not None  # link embeddings come with both
    rows, pairs = ctx.link.pair_rows, ctx.data.pairs
    scores = pair_scores(embeddings, ctx.link.pair_src, ctx.link.pair_dst)
    return link_evaluation(ctx.comm, scores, pairs.label[rows], pairs.split[rows], ctx.config.hits_k,
                           ctx.data.held_by_site)


def write_outcome(ctx: WorkerContext, logits: torch.Tensor, embeddings: torch.Tensor | None, sink: ResultSink) -> None:
    """This rank's predictions (node task), or its evaluation pairs' scores and, with
    ``recommend``, its nodes' recommendations (task link)."""
    if embeddings is None:
        write_predictions(ctx, logits, sink)
        return
    pairs, index = ctx.data.pairs, ctx.link
    assert pairs is not None and index is not None
    rows = index.pair_rows
    scores = pair_scores(embeddings, index.pair_src, index.pair_dst).cpu().numpy().astype(np.float32)
    sink.write_link_scores(ctx.data.part, pairs.src_id[rows], ctx.data.node_id[pairs.dst[rows]], scores,
                           pairs.label[rows].numpy().astype(np.int8), pairs.split[rows])
    if ctx.config.recommend:
        sink.write_recommendations(ctx.data.part, recommendations(embeddings, index, ctx.data, ctx.config.recommend))


def new_log_rows(ctx: WorkerContext, start: int) -> tuple[pa.Table, int]:
    """This rank's log rows from ``start`` on, and the next start."""
    return ctx.comm.log.to_table().slice(start), len(ctx.comm.log.rows)


def from_coordinator(ctx: WorkerContext, packed: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank 0's float32 tensor ``packed`` (of ``shape``; None on the other ranks) on every rank:
    one ``control`` message to each other rank, logged at the launch's layer."""
    comm = ctx.comm
    received = comm.exchange([packed if j else None for j in range(comm.world)],
                             [shape if comm.rank and j == 0 else None for j in range(comm.world)],
                             torch.float32, "control")
    packed = received[0] if comm.rank else packed
    assert packed is not None
    return packed


def stored_head(ctx: WorkerContext, sink: ResultSink, layer: int) -> HeadState:
    """The auxiliary head of the run's stored hidden layer ``layer``, for a launch that starts at the
    last layer: rank 0 reads it (at sites only the coordinator stores models) and sends it to every
    other rank as one (classes, hidden + 1) float32 message (weight, then bias)."""
    classes, hidden = ctx.data.num_classes, ctx.config.hidden
    packed = None
    if ctx.comm.rank == 0:
        head = sink.stored_head(layer)
        packed = torch.cat([head["weight"], head["bias"][:, None]], 1).float()
    packed = from_coordinator(ctx, packed, (classes, hidden + 1))
    return {"weight": packed[:, :hidden].contiguous(), "bias": packed[:, hidden].contiguous()}


def stored_hidden(ctx: WorkerContext, sink: ResultSink, layer: int) -> HiddenLayer:
    """Layer ``layer`` (L-1) as stored, for a launch that starts at the last layer and trains the last
    two together: its recipe from its manifest, its parameters from rank 0 (one flat float32
    message to each rank), and its (aggregated) inputs from its inputs and its halo exchange, made
    again (logged at layer ``layer`` in this launch's log)."""
    knobs = {k: v for k, v in sink.stored_recipe(layer).items() if k in KNOB_NAMES}
    mine = dataclasses.replace(ctx, config=apply_knobs(ctx.config, layer, knobs, end_to_end=False))
    own = own_inputs(ctx, layer, sink)
    module = new_layer(mine, layer, own["full"].shape[1])
    shapes = {k: t.shape for k, t in module.state_dict().items()}
    packed = None
    if ctx.comm.rank == 0:
        state = sink.stored_state(layer)
        packed = torch.cat([state[k].reshape(-1).float() for k in shapes])
    flat = from_coordinator(ctx, packed, (sum(s.numel() for s in shapes.values()),)).to(ctx.device)
    parts = flat.split([s.numel() for s in shapes.values()])
    module.load_state_dict({k: part.view(s) for (k, s), part in zip(shapes.items(), parts)})
    inputs = LayerInputs.exchanged(mine, layer, ctx.config.model, own, [features_transform(ctx.config, knobs)],
                                   keep_own=bool(mine.config.skip))[0]
    return hidden_layer(module, mine.config, inputs)


def with_last_two_together(ctx: WorkerContext, result: LayerResult, hidden: HiddenLayer) -> LayerResult:
    """The last layer's result once the last two layers trained together (``strategies.joint``):
    the kept model's logits, and the joint run's summary in the layer's recipe."""
    kept = result.kept
    assert kept is not None
    before, planned = kept.ctx.progress  # the progress goes on from the kept candidate's rounds
    mine = dataclasses.replace(ctx, progress=(before + kept.trained - ctx.config.layer_rounds(ctx.config.layers), planned))
    joint = train_last_two(mine, hidden, result.module, kept.ctx.config, result.best_round, result.best_val,
                           result.outputs["full"])
    return dataclasses.replace(result, module=joint.module, outputs=dict.fromkeys(result.outputs, joint.logits),
                               best_round=joint.best_round, best_val=joint.best_val,
                               recipe={**result.recipe, "joint": joint.summary}, joint_hidden=joint.hidden_state)


def run_layerwise(ctx: WorkerContext, layers: list[int], sink: ResultSink, skew: LabelSkew | None = None) -> None:
    """Train ``layers`` one after the other; ``skew``: the test that decided the drift correction,
    stored in every layer's recipe entry."""
    rank, cfg = ctx.data.part, ctx.config
    own = own_inputs(ctx, layers[0], sink)
    node_task = ctx.link is None
    # the last layer starts from the previous layer's auxiliary head (node task, no warm start)
    starts_at_last = node_task and cfg.warm_start is None and 1 < layers[0] == cfg.layers
    head = stored_head(ctx, sink, layers[0] - 1) if starts_at_last else None
    log_start = 0
    joint = cfg.trains_jointly
    hidden: HiddenLayer | None = None
    for layer in layers:
        started = time.perf_counter()
        kinds = (LayerInputs, LayerFit) if node_task else (LinkInputs, LinkFit)
        with layer_fits(ctx.device, layer, ctx.comm.world):
            result = train_layer(ctx, layer, own, sink.initial_state(layer), kinds, head)
            if joint and layer == cfg.layers:
                result = with_last_two_together(ctx, result, hidden or stored_hidden(ctx, sink, layer - 1))
        head = head_state(result.module) if node_task else None
        hidden = hidden_of(result.kept) if joint and layer == cfg.layers - 1 and result.kept is not None else None
        result.kept = None  # its inputs are not needed any more
        last = layer == cfg.layers
        evaluation = evaluate(ctx, result.outputs, result.link_embeddings) if last else None
        if last:
            sink.gather_traffic(ctx.comm)
        rows, log_start = new_log_rows(ctx, log_start)
        sink.write_part(layer, rank, ctx.data.node_id, stored_views(ctx, result.outputs), rows)  # type: ignore[arg-type]
        if last:
            write_outcome(ctx, result.outputs["full"], result.link_embeddings, sink)
        ctx.comm.barrier_uncounted()  # every rank has written its part
        recipe = result.recipe if skew is None else {**result.recipe, "drift_correction": skew.describe()}
        summary = LayerSummary(layer, result.best_round, result.best_val, result.rounds, time.perf_counter() - started,
                               recipe=recipe, platform=platform(ctx.device))
        if ctx.comm.rank == 0:
            state = {**result.module.state_dict(), **result.joint_hidden}
            sink.commit_layer(summary, host_state(state), history_table(ctx, layer), evaluation)
        elif sink.every_rank_commits:
            sink.commit_layer(summary, None, None, None)
        log.info("layer %d done: best round %d, val acc %.4f, %d bytes sent by this rank so far, %d rounds in %.3f s%s",
                 layer, result.best_round, result.best_val, ctx.comm.log.total_bytes(), result.loop_rounds,
                 result.loop_seconds, peak_memory_note(ctx.device))
        own = result.outputs  # type: ignore[assignment]


def train_candidates(ctx: WorkerContext, sink: ResultSink, load_refresh: Callable[[int], PartData]
                     ) -> tuple[WorkerContext, EndToEndResult, dict[str, object]]:
    """An end-to-end strategy's whole training once per candidate recipe (``recipe.search_for``),
    keeping the best on validation (``GreedySearch.replaces``; the earlier on ties; ``isolated``
    strategies' candidates by their validation on the full graph). With
    ``--recipe-screen`` (``TrainConfig.screen_epochs``) each candidate trains that many epochs and
    the kept recipe then trains the full epochs from the same initial parameters. Every
    candidate's traffic is in the log. Returns the evaluation context, the kept result and the
    choice (empty without a search)."""
    search = search_for(ctx.config, 1, end_to_end=True, nonnegative=ctx.data.features_nonnegative)
    epochs = ctx.config.epochs
    screen = ctx.config.screen_epochs if search.size > 1 else None
    total = search.size * (screen or epochs) + (epochs if screen else 0)
    done, seconds = 0, 0.0

    def train(knobs: dict[str, object], count: int) -> tuple[WorkerContext, EndToEndResult]:
        """One training of ``count`` epochs with ``knobs``."""
        nonlocal done, seconds
        transform = features_transform(ctx.config, knobs)

        def refresh(period: int) -> PartData:
            data = load_refresh(period)
            return dataclasses.replace(data, x=transform(data.x))

        config = apply_knobs(ctx.config, 1, knobs, end_to_end=True).model_copy(update={"epochs": count})
        mine = dataclasses.replace(ctx, data=dataclasses.replace(ctx.data, x=transform(ctx.data.x)), history=[],
                                   config=config, progress=(done, total))
        eval_ctx, result = config.strategy_spec.load_trainer()(mine, sink, refresh)
        done, seconds = done + result.epochs, seconds + result.loop_seconds
        return eval_ctx, result

    def judged(eval_ctx: WorkerContext, result: EndToEndResult) -> tuple[float, torch.Tensor | None]:
        """A candidate's validation score and hits: the full graph's, where there is a choice,
        for the strategies that validate on their local graphs."""
        if ctx.config.strategy_spec.isolated and search.size > 1:
            return full_graph_validation(eval_ctx, result)
        return result.best_val, result.val_hits

    kept: tuple[WorkerContext, EndToEndResult] | None = None
    kept_hits: torch.Tensor | None = None
    while (candidate := search.next()) is not None:
        trained = train(candidate.knobs, screen or epochs)
        score, hits = judged(*trained)
        paired = None if kept is None else paired_counts(ctx.comm, hits, kept_hits)
        if search.report(score, paired):
            kept, kept_hits = trained, hits
    assert kept is not None
    if screen:  # the kept recipe's full training
        kept = train(search.best.knobs, epochs)
    chosen = search.choice()
    if chosen:
        log.info("recipe chosen on validation: %s", chosen)
    log.info("%d candidate(s)%s: %d epochs in %.3f s (their epoch loops, validation included)", search.size,
             f", {screen} epochs each, then the kept one's {epochs}" if screen else "", done, seconds)
    return kept[0], kept[1], chosen


def run_end_to_end(ctx: WorkerContext, layers: list[int], sink: ResultSink,
                   load_refresh: Callable[[int], PartData]) -> None:
    part, cfg = ctx.data.part, ctx.config
    started = time.perf_counter()
    with layer_fits(ctx.device, 0, ctx.comm.world):
        ctx, result, recipe = train_candidates(ctx, sink, load_refresh)
    evaluation = evaluate(ctx, {v: per_layer[-1] for v, per_layer in result.outputs.items()}, result.link_embeddings)
    sink.gather_traffic(ctx.comm)
    rows, _ = new_log_rows(ctx, 0)
    for layer in layers:
        outputs = {v: per_layer[layer - 1] for v, per_layer in result.outputs.items()}
        sink.write_part(layer, part, ctx.data.node_id, stored_views(ctx, outputs),
                        rows if layer == layers[-1] else rows.slice(0, 0))  # type: ignore[arg-type]
    write_outcome(ctx, result.outputs["full"][-1], result.link_embeddings, sink)
    ctx.comm.barrier_uncounted()
    coordinator = ctx.comm.rank == 0
    if not coordinator and not sink.every_rank_commits:
        return
    seconds = time.perf_counter() - started
    log.info("model done: best epoch %d, val acc %.4f, %d bytes sent by this rank%s", result.best_round,
             result.best_val, ctx.comm.log.total_bytes(), peak_memory_note(ctx.device))
    dropped = [p for p in range(ctx.data.num_parts) if p not in ctx.comm.members]
    where = platform(ctx.device)
    for layer in layers:
        last = layer == layers[-1] and coordinator
        summary = LayerSummary(layer, result.best_round, result.best_val, result.epochs, seconds if last else 0.0, dropped,
                               recipe, where)
        sink.commit_layer(summary, host_state(result.blocks[layer - 1].state_dict()) if coordinator else None,
                          history_table(ctx, None) if last else None, evaluation if last else None)
