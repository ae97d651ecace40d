"""The link task in the strategies (``--task link``; the objective and metrics: ``retexo_core.link``).

Layer-wise (``retexo``, ``centralized --layerwise``): ``LinkInputs`` adds to a layer's frozen
aggregates (GCN's Â·X, SAGE's neighbour mean and own row) the aggregated rows of the remote nodes
this rank scores pairs with, exchanged once per layer (kind ``link_rows``); ``LinkFit`` trains the
layer's block plus a linear head to ``link_dim`` (the last layer's block outputs ``link_dim``
itself) on the link objective, and selects on the validation ROC-AUC. The recipe search, the
rounds, the gradient sync or model averaging and the outputs handed to the next layer are the node
task's (``strategies.retexo``). End to end (``centralized``), ``strategies.endtoend`` trains the
whole model on the same objective with ``link_stats_of`` as its validation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from retexo_core.exchange import exchange_rows, stack_rows
from retexo_core.link import link_loss, validation_stats
from retexo_core.models import Aggregated, Block, Features
from retexo_core.strategies.common import SplitStats, WorkerContext, validate
from retexo_core.strategies.retexo import LayerFit, LayerInputs, Views


class LinkInputs(LayerInputs):
    """A layer's frozen aggregates of the owned rows followed by those of the remote rows
    (``LinkIndex`` order), exchanged once: every round embeds all of them with the current block."""

    def __init__(self, ctx: WorkerContext, block: Block | None, *, aggregated: dict[str, Aggregated] | None = None,
                 inputs: Views | None = None, chunk: int | None = None):
        super().__init__(ctx, block, aggregated=aggregated, inputs=inputs, chunk=chunk)
        assert aggregated is not None and ctx.link is not None, "the link task aggregates (GCN, SAGE)"
        full, plan = aggregated["full"], ctx.link.plan
        ctx.comm.epoch = -1

        def with_remote(rows: Features) -> Features:
            return stack_rows(rows, exchange_rows(ctx.comm, plan, rows, "link_rows"))

        self.rows = Aggregated(with_remote(full.neigh), None if full.own is None else with_remote(full.own))

    def train_outputs(self, gen: torch.Generator, batch: torch.Tensor | None = None) -> torch.Tensor:
        """(n + r, d_out) block outputs of every row this rank embeds (full batch)."""
        return self.block.from_aggregated(self.rows, gen)

    def val_outputs(self) -> torch.Tensor:
        return self.block.from_aggregated(self.rows)


def link_stats_of(ctx: WorkerContext) -> Callable[[torch.Tensor], dict[str, SplitStats]]:
    """Validation of the link task for ``common.validate``: the embeddings of every row this rank
    embeds -> the global validation loss and ROC-AUC (its ``acc`` is the ROC-AUC too)."""
    pairs, index = ctx.data.pairs, ctx.link
    assert pairs is not None and index is not None

    def stats(emb: torch.Tensor) -> dict[str, SplitStats]:
        loss, auc = validation_stats(ctx.comm, emb, index, pairs)
        return {"val": SplitStats(loss, auc, auc)}

    return stats


class LinkFit(LayerFit):
    """One layer's training on the link objective (``retexo_core.link.link_loss``)."""

    def __init__(self, ctx: WorkerContext, layer: int, module, prepared: LayerInputs):  # type: ignore[no-untyped-def]
        super().__init__(ctx, layer, module, prepared)
        assert ctx.link is not None
        self.index = ctx.link
        self.share = len(self.index.train_src) / max(self.index.positives, 1)  # model averaging weight

    def embeddings(self, training: bool) -> torch.Tensor:
        """(n + r, link_dim) embeddings of every row this rank embeds (head included)."""
        if training:
            return self.module.logits(self.prepared.train_outputs(self.gen), self.gen)
        return self.module.logits(self.prepared.val_outputs())

    def loss(self, batch: torch.Tensor | None, divisor: int) -> torch.Tensor:
        return link_loss(self.embeddings(True), self.index, self.ctx.data.num_owned, self.gen)

    def validate(self, round_: int) -> None:
        validate(self.ctx, self.module, self.layer, round_, self.rounds, lambda: self.embeddings(False), self.best,
                 stats_of=link_stats_of(self.ctx))

    def link_embeddings(self) -> torch.Tensor:
        return self.embeddings(False)
