"""What the training core writes its results through: a small interface the run lifecycle hands
to every rank (``runner.results.RunFolder`` stores them in the store's run folder).

Each rank writes its own rows of a layer (embeddings per view, its communication log); once every
rank has written (an uncounted barrier), rank 0 commits the layer with the model, the training
curves, the evaluation and a summary. A rank reads back only its own rows of earlier layers.
In a run of sites, each with its own store (``every_rank_commits``), every rank commits its own
layer folder; rank 0's (the coordinator's) also holds the model, curves, evaluation and every
site's byte totals (``gather_traffic``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch


@dataclass
class LayerSummary:
    """Rank 0's account of a finished layer (or, end-to-end, of the model the layer belongs to)."""

    layer: int
    best_round: int  # round (epoch) whose parameters were kept
    best_val: float  # their validation score (accuracy; ROC-AUC for two classes)
    rounds: int  # rounds (epochs) trained
    seconds: float  # wall time of the training that produced it
    dropped_parts: list[int] = field(default_factory=list)  # tma: partitions lost on the way
    recipe: dict[str, object] = field(default_factory=dict)  # chosen on validation (--normalize-features auto)
    platform: dict[str, object] = field(default_factory=dict)  # where it trained (retexo_core.device.platform)


class ResultSink(Protocol):
    every_rank_commits: bool  # a run of sites: each rank commits the layer in its own store

    def previous_outputs(self, layer: int, part: int, node_id: np.ndarray) -> dict[str, np.ndarray]:
        """This part's rows of layer ``layer``'s outputs per view (``full``; ``train``/``val`` when
        stored), (n, d) float32 each, in ``node_id`` order."""

    def write_part(self, layer: int, part: int, node_id: np.ndarray, outputs: dict[str, np.ndarray],
                   comm: pa.Table) -> None:
        """Store this part's rows of layer ``layer`` (views as above) and what this rank sent."""

    def stored_head(self, layer: int) -> dict[str, torch.Tensor]:
        """The auxiliary head's parameters ("weight" (classes, hidden), "bias" (classes,)) of this
        run's stored hidden layer ``layer`` (committed by an earlier launch, or linked from another
        run); read by rank 0 only, which holds the models at sites too."""

    def stored_state(self, layer: int) -> dict[str, torch.Tensor]:
        """The parameters of this run's stored layer ``layer`` (its ``model.pt``); read by rank 0 only."""

    def stored_recipe(self, layer: int) -> dict[str, Any]:
        """The recipe this run's stored layer ``layer`` trained with (its manifest's ``recipe``: the
        knobs, and the search's scores); every rank reads it (each site has its own manifest)."""

    def initial_state(self, layer: int) -> dict[str, torch.Tensor] | None:
        """The parameters layer ``layer`` (end-to-end: block ``layer``) starts from: the warm-start
        run's, or None for a fresh initialisation."""

    def write_predictions(self, part: int, node_id: np.ndarray, predicted: np.ndarray, score: np.ndarray,
                          split: np.ndarray) -> None:
        """This part's predictions from the last layer: (n,) ids, (n,) int64 classes, (n,) float32
        max softmax probabilities, (n,) split names."""

    def write_link_scores(self, part: int, src: np.ndarray, dst: np.ndarray, score: np.ndarray, label: np.ndarray,
                          split: np.ndarray) -> None:
        """Task link: this part's evaluation pairs scored by the last layer: (p,) source and target
        ids, (p,) float32 logits (dot products), (p,) int8 labels (1: held-out edge), (p,) splits."""

    def write_recommendations(self, part: int, rows: dict[str, np.ndarray]) -> None:
        """Task link with ``recommend``: this part's nodes' best candidates, columns ``node_id,
        candidate`` (int64), ``score`` (float32) and ``rank`` (int32, 1 = best)."""

    def progress(self, layer: int, part: int, done: int, total: int, val_acc: float | None, bytes_sent: int) -> None:
        """Where this rank is: ``done`` of ``total`` rounds (epochs) of ``layer`` (0: the whole
        model of an end-to-end strategy), the last global validation accuracy and the bytes this
        rank has sent so far. Called at every validation point; for display only."""

    def gather_traffic(self, comm: Any) -> None:
        """Before the last layer's parts are written: in a run of sites, every site's byte totals
        reach the coordinator (collective: every rank calls it); nothing otherwise."""

    def commit_layer(self, summary: LayerSummary, state: dict[str, torch.Tensor] | None, history: pa.Table | None,
                     evaluation: list[dict[str, Any]] | None) -> None:
        """Rank 0, after every rank wrote its part: model parameters, curves, evaluation; the layer
        becomes visible to readers at once and completely. In a run of sites every other rank
        commits its own layer too, with ``state``, ``history`` and ``evaluation`` None."""
