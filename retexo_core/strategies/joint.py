"""The last two layers of a layer-wise run trained together, after the greedy layers.

Greedy layer-wise training fits layer L-1 to its auxiliary head, never to what layer L makes of it;
on some graphs that costs a point or two (docs/accuracy-layerwise.md, "The last two layers together"). The
two can train together exactly, with one more halo exchange and no exchange per round: layer L-1's
output at a halo node u is ``block_{L-1}((Â·Z)_u, Z_u)`` (Z: layer L-1's inputs), and u's owner
holds those aggregated inputs already (it computed them for layer L-1). So every owner sends the
aggregated rows of its boundary nodes once (kind ``halo_aggregates``: Â·Z, and Z itself where the
block reads the node's own row); then each round a rank computes layer L-1 at its owned and halo
rows with the shared parameters and layer L over its owned rows, which is what the whole graph
would compute. Gradients are summed every round (``sync=grad``) or the models averaged every
``sync_every`` rounds (``sync=avg``, with ``drift_correction`` too), as in the layers' own training.

The pair starts from the greedy parameters and trains ``last_two_rounds`` rounds with each layer's
chosen recipe (dropout after aggregation, learning rate, weight decay); the best round on
validation is kept only when it beats the greedy model's validation score, so it never replaces a
better greedy model. With gradient sync the pair validates every round, whatever ``eval_every``:
from a trained start its best rounds are few and early (on CiteSeer, 19 to 35 rounds in), which a
pass every 5 rounds often misses, and a pass costs one forward pass and one all-reduce of a few
counts, no halo traffic. With model averaging it validates every ``eval_every`` rounds, as the
layers do (by default the averaging points, where the ranks hold one model). With ``joint_fresh``
the pair then trains again from the layers' initial parameters (``fresh_pair``), as many rounds on
the same rows, and the best on validation of the three is kept.

GAT (``GatPair``, on when ``joint_rounds`` is given): attention at a halo node u reads u's
in-neighbours' inputs with weights that depend on the parameters, so no aggregate serves every
round. Its one extra exchange (``retexo_core.two_hop``) is u's in-edges and the inputs of their
sources that the rank does not hold; then each round a rank computes layer L-1 at its owned and
halo rows from them, exactly as their owners would.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from retexo_core.config import TrainConfig
from retexo_core.exchange import exchange_rows, stack_rows
from retexo_core.models import Aggregated, Block, Features, LayerWithHead, LocalGraph, seeded
from retexo_core.sparse import SparseMatrix, spmm
from retexo_core.strategies.common import (
    BestState, DriftCorrection, WorkerContext, average_parameters, split_stats, sync_gradients, validate,
)
from retexo_core.two_hop import TwoHop, two_hop

if TYPE_CHECKING:
    from retexo_core.strategies.retexo import LayerFit, LayerInputs

log = logging.getLogger("retexo.train")
KIND = "halo_aggregates"
HIDDEN_PREFIX = "joint_hidden."  # layer L-1's block in the last layer's stored state, where the pair replaced the greedy model


@dataclass
class HiddenLayer:
    """Layer L-1 as its greedy fit kept it."""

    module: LayerWithHead
    config: TrainConfig  # its candidate's configuration (the recipe it trained with)
    # GCN / SAGE: (n, d) frozen aggregated inputs of the owned nodes; GAT: the (n + h, d) local inputs
    inputs: Aggregated | Features


@dataclass
class JointResult:
    """The outcome of the joint training: the logits to keep and what the layer's manifest says."""

    logits: torch.Tensor  # (n, classes) of the owned nodes, by the kept model (the greedy one's unless replaced)
    module: LayerWithHead  # layer L as kept
    hidden_state: dict[str, torch.Tensor]  # layer L-1's block (keys HIDDEN_PREFIX + name) when the pair replaced it
    best_round: int
    best_val: float
    summary: dict[str, object]  # for the manifest: rounds, the best round's val, the greedy val, kept or not


class Pair(nn.Module):
    """Layer L-1's block and layer L's module, whose parameters are synchronised as one (GCN, SAGE)."""

    def __init__(self, hidden: LayerWithHead, last: LayerWithHead):
        super().__init__()
        self.hidden, self.last = hidden.block, last

    @staticmethod
    def rows(graph: LocalGraph, targets: torch.Tensor) -> SparseMatrix:
        """The owned ``targets``' rows of the local graph: (t, N) adjacency."""
        return graph.adj.select_rows(targets)

    def logits(self, inputs: Aggregated, adj: SparseMatrix, targets: torch.Tensor, gen: torch.Generator | None = None
               ) -> torch.Tensor:
        """(t, classes) logits of the owned ``targets`` from layer L-1's aggregated inputs of the
        owned and halo rows (N, d) and ``adj``, the targets' rows of the local graph (t, N)."""
        h = self.hidden.from_aggregated(inputs, gen)  # (N, hidden): owned rows, then the halo's
        return self.last.logits(self.last.block.from_aggregated(Aggregated(spmm(adj, h), h[targets]), gen), gen)


class GatPair(Pair):
    """GAT: layer L-1 propagates over the owned and halo nodes' in-edges in every round."""

    @staticmethod
    def rows(graph: LocalGraph, targets: torch.Tensor) -> LocalGraph:  # type: ignore[override]
        """The local graph of the owned ``targets`` only (t, N)."""
        return graph.restrict(targets)

    def logits(self, inputs: TwoHop, graph: LocalGraph, targets: torch.Tensor,  # type: ignore[override]
               gen: torch.Generator | None = None) -> torch.Tensor:
        """(t, classes) logits of the owned ``targets`` (``graph``: their rows of the local graph)
        from layer L-1's inputs of the owned, halo and two-hop rows and its graph (``TwoHop``)."""
        h = self.hidden(inputs.x, inputs.graph, gen)  # (n + h, hidden): owned rows, then the halo's
        return self.last.logits(self.last.block(h, graph, gen), gen)


def make_pair(hidden: LayerWithHead, last: LayerWithHead) -> Pair:
    """The pair of ``hidden``'s and ``last``'s blocks, for their model."""
    return (GatPair if hidden.block.model == "gat" else Pair)(hidden, last)


def pair_inputs(ctx: WorkerContext, hidden: HiddenLayer) -> Aggregated | TwoHop:
    """The one extra exchange, logged at layer L, round -1. GCN / SAGE: layer L-1's aggregated
    inputs of every halo node, sent by its owner ((n + h, d) rows, owned first). GAT: the halo
    nodes' in-edges and the rows of their sources (``retexo_core.two_hop``)."""
    comm, plan = ctx.comm, ctx.plans["full"]
    comm.layer, comm.epoch = ctx.config.layers, -1
    if not isinstance(hidden.inputs, Aggregated):
        return two_hop(comm, ctx.data, plan, hidden.inputs, ctx.device)

    def rows(x: Features) -> Features:
        return stack_rows(x, exchange_rows(comm, plan, x, KIND))

    owned = hidden.inputs
    return Aggregated(rows(owned.neigh), None if owned.own is None else rows(owned.own))


def fresh_pair(hidden: LayerWithHead, last: LayerWithHead, seed: int, layer: int, classes: int,
               device: torch.device) -> Pair:
    """Layers ``layer`` - 1 and ``layer`` built again on ``device`` from their initial parameters
    (the seeds ``new_layer`` draws from for training seed ``seed``), with the blocks of ``hidden``
    and ``last`` (so that the kept pair loads where the greedy one would) and, as end-to-end
    training has one recipe, layer L-1's dropout in both. Layer L's skip connection, chosen for a
    layer trained on frozen inputs, starts at zero and stays there where layer L-1 has none: on
    CiteSeer the pair trained from scratch with it fits the few training labels through the nodes'
    own rows (docs/accuracy-layerwise.md, the pair from scratch)."""

    def block_like(block: Block, seed: int) -> Block:
        conv = block.conv
        in_dim = (conv.lin_l if block.model == "sage" else conv.lin).weight.shape[1]
        with seeded(seed):
            return Block(block.model, in_dim, block.out_dim, getattr(conv, "heads", 1), hidden.block.p, block.last,
                         norm=block.norm is not None, skip=block.skip is not None,
                         attention_dropout=hidden.block.attention_p).to(device)

    fresh_hidden = LayerWithHead(block_like(hidden.block, seed * 1000 + layer - 1), classes)
    fresh_last = LayerWithHead(block_like(last.block, seed * 1000 + layer), classes)
    skip = fresh_last.block.skip
    if skip is not None and hidden.block.skip is None:
        torch.nn.init.zeros_(skip.weight)
        skip.weight.requires_grad_(False)
    return make_pair(fresh_hidden, fresh_last)


def train_last_two(ctx: WorkerContext, hidden: HiddenLayer, last: LayerWithHead, last_config: TrainConfig,
                   greedy_round: int, greedy_val: float, greedy_logits: torch.Tensor) -> JointResult:
    """Layers L-1 and L together from their greedy parameters (copies: the greedy modules stay as
    they are), ``ctx.config.last_two_rounds`` rounds, then with ``joint_fresh`` from their initial
    parameters as many rounds; see the module docstring."""
    cfg, layer = ctx.config, ctx.config.layers
    started = time.perf_counter()
    inputs = pair_inputs(ctx, hidden)
    pair = make_pair(copy.deepcopy(hidden.module), copy.deepcopy(last))
    graph = ctx.graphs["full"]
    eval_rows = ctx.eval_rows
    eval_adj = pair.rows(graph, eval_rows)
    rounds, start = cfg.last_two_rounds, cfg.layer_rounds(layer)
    best = BestState()
    pair.eval()
    with torch.no_grad():  # the start (the greedy model, computed from the exchanged rows): the score to beat
        start_val = split_stats(ctx, pair.logits(inputs, eval_adj, eval_rows), eval_rows)["val"].score
    best.offer(pair, start_val, start - 1)
    hidden_rates = rates(hidden.config, layer - 1)
    trained = train_pair(ctx, pair, (hidden_rates, rates(last_config, layer)), inputs, best, start, stream=layer + 100)
    kept, summary = pair, {"rounds": trained}
    if cfg.joint_fresh:  # its own best: patience counts from its own rounds
        fresh = fresh_pair(hidden.module, last, cfg.seed, layer, ctx.output_width, ctx.device)
        fresh_best = BestState()
        summary["fresh_rounds"] = train_pair(ctx, fresh, (hidden_rates, hidden_rates), inputs, fresh_best,
                                             start + rounds, stream=layer + 200)
        summary["fresh_best_val"] = fresh_best.accuracy
        if fresh_best.accuracy > best.accuracy:
            kept, best = fresh, fresh_best
    replaces = best.round >= start
    model = "greedy" if not replaces else "fresh" if kept is not pair else "joint"
    kept.eval()
    if replaces:
        best.restore(kept)
        with torch.no_grad():
            owned = torch.arange(ctx.data.num_owned, device=ctx.device)
            logits = kept.logits(inputs, pair.rows(graph, owned), owned)
    summary |= {"best_round": best.round if replaces else None, "best_val": best.accuracy, "start_val": start_val,
                "model": model, "seconds": round(time.perf_counter() - started, 3)}
    log.info("layers %d-%d together: best val %.4f at round %d, the greedy model's %.4f: %s", layer - 1,
             layer, best.accuracy, best.round, start_val, "the greedy model stays" if not replaces else f"{model} kept")
    if not replaces:
        return JointResult(greedy_logits, last, {}, greedy_round, greedy_val, summary)
    hidden_state = {HIDDEN_PREFIX + k: v for k, v in kept.hidden.state_dict().items()}
    return JointResult(logits, kept.last, hidden_state, best.round, best.accuracy, summary)


def rates(config: TrainConfig, layer: int) -> tuple[float, float]:
    """(learning rate, weight decay) of ``layer`` under ``config``'s recipe."""
    return config.layer_lr(layer), config.weight_decay if config.decays_layer(layer) else 0.0


def train_pair(ctx: WorkerContext, pair: Pair, layer_rates: tuple[tuple[float, float], tuple[float, float]],
               inputs: Aggregated | TwoHop, best: BestState, first_round: int, stream: int) -> int:
    """Train ``pair`` for ``ctx.config.last_two_rounds`` rounds numbered from ``first_round`` (the
    comm log's epochs) with dropout drawn from ``stream``, each layer with its (learning rate,
    weight decay) of ``layer_rates``, offering its validated rounds to ``best``; returns the rounds
    trained (fewer on early stopping)."""
    cfg, comm, layer = ctx.config, ctx.comm, ctx.config.layers
    optimizer = torch.optim.Adam([{"params": [p for p in part.parameters() if p.requires_grad], "lr": lr,
                                   "weight_decay": decay}
                                  for part, (lr, decay) in zip((pair.hidden, pair.last), layer_rates, strict=True)],
                                 fused=True)
    graph = ctx.graphs["full"]
    train_rows, eval_rows = ctx.train_rows, ctx.eval_rows
    train_adj, eval_adj = pair.rows(graph, train_rows), pair.rows(graph, eval_rows)
    gen = ctx.generator(stream)
    divisor = max(ctx.train_count if cfg.sync == "grad" else ctx.local_train, 1)
    share = ctx.local_train / max(ctx.train_count, 1)
    rounds, total = cfg.last_two_rounds, first_round + cfg.last_two_rounds
    every = 1 if cfg.sync == "grad" else cfg.eval_every  # validation passes: see the module docstring

    def loss() -> torch.Tensor:
        logits = pair.logits(inputs, train_adj, train_rows, gen)
        return F.cross_entropy(logits, ctx.data.y[train_rows], reduction="sum") / divisor

    drift = DriftCorrection(comm, pair, share, loss) if cfg.drift_correction else None
    for round_ in range(rounds):
        comm.epoch = first_round + round_
        pair.train()
        if drift is not None:
            drift.before_round()
        optimizer.zero_grad()
        loss().backward()
        if cfg.sync == "grad":
            sync_gradients(comm, pair)
        elif drift is not None:
            drift.apply()
        optimizer.step()
        last_round = round_ == rounds - 1
        if cfg.sync == "avg" and ((round_ + 1) % cfg.sync_every == 0 or last_round):
            average_parameters(comm, pair, share)
            if drift is not None:
                drift.averaged()
        if (round_ + 1) % every == 0 or last_round:
            validate(ctx, pair, layer, first_round + round_, total,
                     lambda: pair.logits(inputs, eval_adj, eval_rows), best, rows=eval_rows)
            if best.stale(first_round + round_, cfg.patience):
                break
    return round_ + 1


def hidden_layer(module: LayerWithHead, config: TrainConfig, prepared: LayerInputs) -> HiddenLayer:
    """Layer L-1 with the inputs its block reads: GAT its local inputs; GCN / SAGE the aggregated
    inputs, with the node's own rows only where it has a skip connection or is SAGE (the inputs may
    hold them for another recipe candidate)."""
    block = module.block
    if block.model == "gat":
        return HiddenLayer(module, config, prepared.inputs["full"])  # type: ignore[index]
    aggregated = prepared.aggregated["full"]
    reads_own = block.model == "sage" or block.skip is not None
    return HiddenLayer(module, config, Aggregated(aggregated.neigh, aggregated.own if reads_own else None))


def hidden_of(fit: LayerFit) -> HiddenLayer:
    """Layer L-1's ``HiddenLayer`` from its kept fit."""
    return hidden_layer(fit.module, fit.ctx.config, fit.prepared)
