"""Pieces every strategy uses: the worker context, loss, synchronisation, evaluation, history."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from retexo_core.comm.communicator import Communicator
from retexo_core.config import TrainConfig
from retexo_core.data import SPLIT_NAMES, PartData
from retexo_core.device import CPU
from retexo_core.exchange import ExchangePlan, full_plan, view_plan
from retexo_core.halo import VIEWS, HaloPlan, build_plan
from retexo_core.link import LinkIndex, link_index
from retexo_core.metrics import accuracy, confusion, histogram_auc, macro_f1, roc_auc, score_histogram
from retexo_core.models import LocalGraph, local_graph

log = logging.getLogger("retexo.train")


@dataclass
class WorkerContext:
    """Everything one rank trains with.

    ``graphs`` / ``plans`` map each view (train, val, full; see ``retexo_core.halo``) to its local
    graph and exchange plan; in the transductive setting all three names map to the same objects.
    """

    comm: Communicator
    data: PartData
    config: TrainConfig
    plan: HaloPlan | None  # None for strategies that train without a halo (tma, grappa)
    train_count: int  # train nodes over all ranks
    graphs: dict[str, LocalGraph]
    plans: dict[str, ExchangePlan]
    history: list[dict[str, object]] = field(default_factory=list)
    on_progress: Callable[[int, int, int, float | None], None] | None = None  # (layer, done, total, val score)
    # (rounds trained before this training's first, rounds of all the layer's or run's recipe candidates;
    # 0: this training's own): the progress spans every candidate
    progress: tuple[int, int] = (0, 0)
    device: torch.device = CPU  # where this rank computes: its data, graphs and modules are there
    link: LinkIndex | None = None  # task link: the rows this rank embeds and the pairs it scores

    def generator(self, offset: int = 0, device: torch.device | None = None) -> torch.Generator:
        """This rank's own random stream (dropout masks, batches), never the global RNG; on its
        device unless ``device`` says otherwise."""
        return torch.Generator(device=device or self.device).manual_seed(
            self.config.seed * 1000 + offset + 7919 * (self.data.part + 1))

    def on(self, device: torch.device) -> "WorkerContext":
        """This context with its data and graphs on ``device`` (a graph shared by several views
        moves once)."""
        moved: dict[int, LocalGraph] = {}
        graphs = {v: moved.setdefault(id(g), g.to(device)) for v, g in self.graphs.items()}
        link = None if self.link is None else self.link.to(device)
        return dataclasses.replace(self, data=self.data.to(device), graphs=graphs, device=device, link=link)

    @property
    def output_width(self) -> int:
        """The last layer's width (and that of a layer-wise head): the classes, or the link task's embedding width."""
        return self.config.link_dim if self.config.task == "link" else self.data.num_classes

    @property
    def train_rows(self) -> torch.Tensor:
        """(t,) positions of this rank's train nodes."""
        return torch.nonzero(self.data.masks["train"]).flatten()

    @property
    def eval_rows(self) -> torch.Tensor:
        """(e,) positions of the labelled nodes of the splits measured during training."""
        y, masks = self.data.y, self.data.masks
        keep = torch.zeros_like(y, dtype=torch.bool)
        for split in self.round_splits:
            keep |= masks[split] & (y >= 0)
        return torch.nonzero(keep).flatten()

    @property
    def inductive(self) -> bool:
        return self.config.setting == "inductive"

    @property
    def views(self) -> tuple[str, ...]:
        """The distinct views to compute (one when transductive)."""
        return VIEWS if self.inductive else ("full",)

    @property
    def round_splits(self) -> tuple[str, ...]:
        """Splits measured every round on the val view (test only when it is the full graph)."""
        return ("train", "val") if self.inductive else SPLIT_NAMES

    @property
    def local_train(self) -> int:
        return int(self.data.masks["train"].sum())


def make_context(comm: Communicator, data: PartData, config: TrainConfig, device: torch.device = CPU) -> WorkerContext:
    """Run the halo setup protocol and the train-count all-reduce; build the views' graphs and plans
    (in host memory), then move the data and the graphs to ``device``."""
    data = data.to(CPU)
    inductive = config.setting == "inductive"
    plan = build_plan(comm, data, inductive)
    train_count = int(comm.all_reduce(torch.tensor([float(data.masks["train"].sum())], dtype=torch.float64), "control")[0])
    n, sources = data.num_owned, data.num_owned + data.num_halo
    full = local_graph(config.model, data.src, data.dst, plan.degree["full"], n, sources)
    if not inductive:
        every = full_plan(plan)
        link = link_index(comm, data, config.seed) if config.task == "link" else None
        return WorkerContext(comm, data, config, plan, train_count, dict.fromkeys(VIEWS, full),
                             dict.fromkeys(VIEWS, every), link=link).on(device)
    graphs, plans = {"full": full}, {"full": full_plan(plan)}
    for view in ("train", "val"):
        visible = plan.visible(view)
        graphs[view] = local_graph(config.model, data.src, data.dst, plan.degree[view], n, sources,
                                   visible[data.src] & visible[data.dst])
        plans[view] = view_plan(plan, n, view)
    return WorkerContext(comm, data, config, plan, train_count, graphs, plans).on(device)


def train_loss(ctx: WorkerContext, logits: torch.Tensor, global_mean: bool,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy over this rank's train nodes, divided by the global train count (so summed
    gradients are the centralized gradient) or by the local count (local steps).

    ``logits``: (n, C) of every owned node, or (len(rows), C) of the train rows ``rows`` only.
    """
    if rows is None:
        mask = ctx.data.masks["train"]
        total = F.cross_entropy(logits[mask], ctx.data.y[mask], reduction="sum")
    else:
        total = F.cross_entropy(logits, ctx.data.y[rows], reduction="sum")
    return total / max(ctx.train_count if global_mean else ctx.local_train, 1)


def adam(module: nn.Module, lr: float, weight_decay: float, decayed: nn.Module | None = None) -> torch.optim.Adam:
    """Adam over the module's parameters (the fused CPU kernel); weight decay on the parameters of
    ``decayed`` only (all of them when None)."""
    if decayed is None:
        return torch.optim.Adam(module.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    chosen = {id(p) for p in decayed.parameters()}
    groups = [{"params": [p for p in module.parameters() if id(p) in chosen], "weight_decay": weight_decay},
              {"params": [p for p in module.parameters() if id(p) not in chosen], "weight_decay": 0.0}]
    return torch.optim.Adam([g for g in groups if g["params"]], lr=lr, fused=True)


def flat_grads(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """(sum of the parameters' sizes,) their gradients in order, zeros where a parameter has none."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def sync_gradients(comm: Communicator, module: nn.Module) -> None:
    """Sum gradients over ranks (one ring all-reduce of all parameters, kind ``grad_sync``)."""
    total = comm.all_reduce(flat_grads(module.parameters()), "grad_sync")  # a new tensor: its slices become the grads
    offset = 0
    for p in module.parameters():
        count = p.numel()
        p.grad = total[offset:offset + count].view(p.shape)
        offset += count


def average_parameters(comm: Communicator, module: nn.Module, weight: float, kind: str = "model_sync") -> None:
    """Replace parameters by the weighted sum over ranks of ``weight * parameters``."""
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in module.parameters()]) * weight
        total = comm.all_reduce(flat, kind)
        offset = 0
        for p in module.parameters():
            p.copy_(total[offset:offset + p.numel()].reshape(p.shape))
            offset += p.numel()


class DriftCorrection:
    """SCAFFOLD-style correction of local steps under model averaging (``drift_correction``).

    At the averaged model x, ``refresh`` takes this rank's gradient g_i(x) of ``local_loss`` (its
    train rows' mean loss) and one all-reduce (kind ``grad_sync``) of ``share * g_i(x)`` gives the
    global gradient g(x), ``share`` being this rank's fraction of the train rows. ``apply`` then adds
    g(x) - g_i(x) to every local step's gradient, so that a rank whose rows hold mostly some classes
    steps along the whole graph's direction rather than its own. Only the parameters that train
    are corrected; the correction is flat, in their order."""

    def __init__(self, comm: Communicator, module: nn.Module, share: float, local_loss: Callable[[], torch.Tensor]):
        self.comm, self.share, self.local_loss = comm, share, local_loss
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.delta: torch.Tensor | None = None  # (sum of the parameters' sizes,) g(x) - g_i(x)

    def before_round(self) -> None:
        """Refresh the correction if the model was averaged since the last refresh (or at the start)."""
        if self.delta is None:
            self.refresh()

    def averaged(self) -> None:
        """The parameters were just averaged: the next round refreshes the correction first, so
        that an averaging after the last round costs nothing more."""
        self.delta = None

    def refresh(self) -> None:
        for p in self.params:
            p.grad = None
        self.local_loss().backward()
        local = flat_grads(self.params)
        self.delta = self.comm.all_reduce(local * self.share, "grad_sync") - local
        for p in self.params:
            p.grad = None

    def apply(self) -> None:
        assert self.delta is not None, "refresh before the first local step"
        offset = 0
        for p in self.params:
            count = p.numel()
            if p.grad is not None:
                p.grad.add_(self.delta[offset:offset + count].view(p.shape))
            offset += count


AUC_BINS = 256  # histogram bins of the positive-class logit margin, for the validation ROC-AUC
AUC_MARGIN = 8.0  # margins (logit of class 1 minus logit of class 0) are clipped to [-8, 8] (bins 1/16 wide)


class SplitStats(NamedTuple):
    """Global loss and accuracy of one split; for two-class tasks also its ROC-AUC (else NaN)."""

    loss: float
    acc: float
    roc_auc: float = float("nan")

    @property
    def score(self) -> float:
        """What model selection maximises: ROC-AUC for two-class tasks, accuracy otherwise."""
        return self.acc if np.isnan(self.roc_auc) else self.roc_auc


def margin_histogram(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(2, AUC_BINS) float64 counts of the negatives' and the positives' margins ``logits[:, 1] -
    logits[:, 0]`` (monotone in the positive-class probability), clipped to ±AUC_MARGIN."""
    return score_histogram(logits[:, 1] - logits[:, 0], y, AUC_BINS, AUC_MARGIN)


def labelled(ctx: WorkerContext, split: str, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels of every owned node (or of the nodes ``rows``) and the mask of those in ``split``
    with a label."""
    y = ctx.data.y if rows is None else ctx.data.y[rows]
    mask = ctx.data.masks[split] if rows is None else ctx.data.masks[split][rows]
    return y, mask & (y >= 0)


def split_stats(ctx: WorkerContext, logits: torch.Tensor, rows: torch.Tensor | None = None) -> dict[str, SplitStats]:
    """Global loss and accuracy of ``ctx.round_splits`` from one all-reduce of 3 numbers per split
    (control); ``logits`` are the val view's, of every owned node or of the nodes ``rows``. Two-class
    tasks add the val split's margin histogram (2 x AUC_BINS numbers) to the same all-reduce, for
    its ROC-AUC: counts leave a rank, never a node's score or label."""
    values = []
    binary = ctx.data.num_classes == 2
    for name in ctx.round_splits:
        y, mask = labelled(ctx, name, rows)
        values += [F.cross_entropy(logits[mask], y[mask], reduction="sum"),  # 0 for an empty split
                   (logits[mask].argmax(1) == y[mask]).sum(), mask.sum()]
        if binary and name == "val":
            histogram = margin_histogram(logits[mask], y[mask]).flatten()
    sent = torch.stack([v.double() for v in values])
    if binary:
        sent = torch.cat([sent, histogram])
    total = ctx.comm.all_reduce(sent.cpu(), "control").numpy()  # one copy from the device
    stats = {}
    for k, name in enumerate(ctx.round_splits):
        loss, correct, count = total[3 * k: 3 * k + 3]
        auc = float("nan")
        if binary and name == "val":
            auc = histogram_auc(total[len(values):].reshape(2, AUC_BINS))
        stats[name] = SplitStats(loss / count, correct / count, auc) if count else SplitStats(float("nan"), float("nan"))
    return stats


def record(ctx: WorkerContext, layer: int, round_: int, stats: dict[str, SplitStats], total: int) -> None:
    """Keep the round's metrics, report progress (the val score); log about ten lines per layer."""
    for split, s in stats.items():
        ctx.history.append({"layer": layer, "round": round_, "split": split, "loss": s.loss, "acc": s.acc})
    if ctx.on_progress is not None:
        before, planned = ctx.progress
        ctx.on_progress(layer, before + round_ + 1, planned or total, stats["val"].score if "val" in stats else None)
    if round_ % max(1, total // 10) == 0 or round_ == total - 1:
        log.info("layer %d round %d/%d: %s", layer, round_ + 1, total, ", ".join(
            f"{name} loss {s.loss:.4f} acc {s.acc:.4f}" + ("" if np.isnan(s.roc_auc) else f" roc_auc {s.roc_auc:.4f}")
            for name, s in stats.items()))


def validate(ctx: WorkerContext, module: nn.Module, layer: int, round_: int, total: int,
             val_logits: Callable[[], torch.Tensor], best: "BestState",
             stats_of: Callable[[torch.Tensor], dict[str, SplitStats] | None] | None = None,
             rows: torch.Tensor | None = None) -> None:
    """One model-selection point: logits of the val view (eval mode; of the nodes ``rows`` when
    given), global stats, history, best (by val accuracy, or val ROC-AUC for two classes)."""
    module.eval()
    with torch.no_grad():
        logits = val_logits()
    stats = (stats_of or (lambda l: split_stats(ctx, l, rows)))(logits)
    if stats is None:  # this point was skipped (a tolerant strategy lost a rank during it)
        return
    record(ctx, layer, round_, stats, total)
    best.offer(module, stats["val"].score, round_, lambda: val_hits(ctx, logits, rows))


def val_hits(ctx: WorkerContext, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """(v,) bool on the CPU: whether ``logits`` (the val view's, of every owned node or of the nodes
    ``rows``) classify each of this rank's validation nodes right; None where the validation
    score is no accuracy (ROC-AUC for two classes; the link task's scores)."""
    if ctx.link is not None or ctx.data.num_classes == 2:
        return None
    y, mask = labelled(ctx, "val", rows)
    return (logits[mask].argmax(1) == y[mask]).cpu()


def paired_counts(comm: Communicator, hits: torch.Tensor | None, kept: torch.Tensor | None) -> tuple[int, int] | None:
    """(gained, lost): the validation nodes, over every rank, that ``hits`` classifies right and
    ``kept`` wrong, and the reverse (``val_hits`` of two models); one all-reduce of 2 numbers
    (control). None, without traffic, where the score is no accuracy (either is None: the same on
    every rank)."""
    if hits is None or kept is None:
        return None
    local = torch.stack([(hits & ~kept).sum(), (~hits & kept).sum()]).double()
    gained, lost = comm.all_reduce(local, "control").tolist()
    return round(gained), round(lost)  # exact counts (secure aggregation sums them in fixed point)


class BestState:
    """Keeps the parameters with the best validation score (first best wins; no val -> last) and,
    where the score is an accuracy, which validation nodes they classify right (``hits``)."""

    def __init__(self) -> None:
        self.accuracy = -1.0
        self.round = -1
        self.state: dict[str, torch.Tensor] | None = None
        self.hits: torch.Tensor | None = None

    def offer(self, module: nn.Module, val_accuracy: float, round_: int,
              hits: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        score = val_accuracy if not np.isnan(val_accuracy) else float(round_)
        if self.state is None or score > self.accuracy:
            self.accuracy, self.round = score, round_
            self.state = copy.deepcopy(module.state_dict())
            self.hits = hits()

    def stale(self, round_: int, patience: int | None) -> bool:
        """True when the best is ``patience`` or more rounds old (the same on every rank: validation
        accuracy is global)."""
        return patience is not None and round_ - self.round >= patience

    def restore(self, module: nn.Module) -> None:
        if self.state is not None:
            module.load_state_dict(self.state)


SPLIT_VIEW = {"train": "train", "val": "val", "test": "full"}


def final_evaluation(ctx: WorkerContext, outputs: dict[str, torch.Tensor]) -> list[dict[str, object]]:
    """Accuracy, macro-F1 (and ROC-AUC for two classes) per split, from summed confusion matrices.

    ``outputs`` maps each view to the owned logits; a split is scored on its own view (train on
    train, val on val, test on the full graph). One all-reduce of (3, C, C) counts; for binary
    tasks the positive-class scores are also gathered to rank 0 (control traffic). Identical on
    every rank except ``roc_auc`` (rank 0 only; not computed when the data is held by sites).
    """
    data, comm = ctx.data, ctx.comm
    logits_of = {s: outputs[SPLIT_VIEW[s]] for s in SPLIT_NAMES}
    matrices = torch.stack([confusion(logits_of[s], data.y, data.masks[s], data.num_classes) for s in SPLIT_NAMES]).cpu()
    matrices = comm.all_reduce(matrices, "control").numpy()
    aucs = {s: float("nan") for s in SPLIT_NAMES}
    if data.num_classes == 2 and not data.held_by_site:  # sites: no per-node score or label leaves them
        for s in SPLIT_NAMES:
            scores = torch.softmax(logits_of[s], dim=1)[:, 1].double()
            mask = data.masks[s] & (data.y >= 0)
            local = torch.stack([scores[mask], data.y[mask].double()], dim=1).cpu()
            send = [local if j == 0 else local[:0] for j in range(comm.world)]
            got = comm.exchange_variable(send, "control")
            if comm.rank == 0:
                pairs = torch.cat([local] + [got[j] for j in range(1, comm.world)]).numpy()
                aucs[s] = roc_auc(pairs[:, 0], pairs[:, 1].astype(np.int64))
    return [
        {"split": s, "accuracy": accuracy(m), "macro_f1": macro_f1(m), "roc_auc": aucs[s], "nodes": int(m.sum())}
        for s, m in zip(SPLIT_NAMES, matrices)
    ]
