"""Whether the ranks' training labels differ: where they do, ``--sync avg`` corrects its drift by default.

Model averaging drifts when each rank's local steps follow a different loss, and in node
classification the ranks' losses differ most when their train nodes hold different mixes of
classes (parts cut by METIS on a homophilous graph, sites of different organisations). A random
cut gives every rank the same mix up to sampling noise. The decision is a chi-square test of
independence between rank and label over the train nodes (Pearson's statistic on the ranks x
classes table of counts) and its effect size, the bias-corrected Cramér's V (Bergsma, 2013): the
labels differ when the test rejects independence at ``SIGNIFICANCE`` and V is at least
``SMALL_EFFECT`` (``stages.resolve_drift_correction`` then turns the correction on). Under
independence the p-value is uniform, so a random cut passes in about one run of a thousand at most
(and only with V above the floor).

Distributed, no rank sends its table: one all-reduce of (class counts, 1 if the rank has train
nodes) gives the class totals, then one all-reduce of each rank's own share of the statistic,
sum over classes of (O - E)^2 / E, gives the statistic. Both are ``control`` traffic of C + 1
and 1 float64 values (masked like gradients under ``--secure-agg``), and every rank reaches the
same decision from the same sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from retexo_core.comm.communicator import Communicator

SIGNIFICANCE = 1e-3  # p-value below which rank and label are taken to depend on each other
SMALL_EFFECT = 0.1  # Cramér's V from which the dependence is large enough to correct (Cohen's "small")


@dataclass(frozen=True)
class LabelSkew:
    """The test of independence between rank and label over the train nodes."""

    chi2: float  # Pearson's statistic
    df: int  # (ranks with train nodes - 1) x (classes present - 1)
    nodes: int  # train nodes in all
    cramers_v: float  # bias-corrected, 0 (the same mix everywhere) to 1 (each class on one rank)

    @property
    def p_value(self) -> float:
        """P(chi-square with ``df`` degrees of freedom >= ``chi2``); 1 when there is nothing to test."""
        if self.df <= 0:
            return 1.0
        return float(torch.special.gammaincc(torch.tensor(self.df / 2, dtype=torch.float64),
                                             torch.tensor(self.chi2 / 2, dtype=torch.float64)))

    @property
    def differs(self) -> bool:
        """Whether the ranks' labels differ enough to correct the drift of model averaging."""
        return self.p_value < SIGNIFICANCE and self.cramers_v >= SMALL_EFFECT

    def describe(self) -> dict[str, float | int | bool]:
        """What the layer manifests store."""
        return {"on": self.differs, "chi2": round(self.chi2, 3), "df": self.df, "p_value": self.p_value,
                "cramers_v": round(self.cramers_v, 4), "train_nodes": self.nodes}


def skew_from_sums(chi2: float, nodes: int, ranks: int, classes: int) -> LabelSkew:
    """The test from the statistic, the train nodes, and the ranks and classes that have any."""
    df = max(ranks - 1, 0) * max(classes - 1, 0)
    if df == 0 or nodes < 2:
        return LabelSkew(chi2, 0, nodes, 0.0)
    phi2 = max(chi2 / nodes - df / (nodes - 1), 0.0)
    rows = ranks - (ranks - 1) ** 2 / (nodes - 1)
    cols = classes - (classes - 1) ** 2 / (nodes - 1)
    denominator = min(rows - 1, cols - 1)
    return LabelSkew(chi2, df, nodes, math.sqrt(phi2 / denominator) if denominator > 0 else 0.0)


def skew_of_table(counts: np.ndarray) -> LabelSkew:
    """The test from a whole (ranks, classes) table of train-label counts (what the ranks compute
    together without any of them holding the table)."""
    counts = np.asarray(counts, dtype=np.float64)
    totals, sizes = counts.sum(axis=0), counts.sum(axis=1)
    nodes = counts.sum()
    present = totals > 0
    expected = np.outer(sizes, totals[present]) / max(nodes, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(expected > 0, (counts[:, present] - expected) ** 2 / expected, 0.0)
    return skew_from_sums(float(terms.sum()), int(nodes), int((sizes > 0).sum()), int(present.sum()))


def label_skew(comm: Communicator, train_labels: torch.Tensor, num_classes: int) -> LabelSkew:
    """The test over every rank's train nodes; ``train_labels``: (t,) this rank's train labels
    (0..num_classes-1). Two ``control`` all-reduces (module docstring); the same result on every rank."""
    reduce = comm.all_reduce_masked if comm.masks is not None and comm.world > 1 else comm.all_reduce
    counts = torch.bincount(train_labels.cpu().long(), minlength=num_classes).to(torch.float64)
    mine = float(counts.sum())
    summed = reduce(torch.cat([counts, torch.tensor([1.0 if mine > 0 else 0.0], dtype=torch.float64)]), "control")
    totals, ranks = summed[:-1], int(round(float(summed[-1])))
    nodes = float(totals.sum())
    present = totals > 0
    share = torch.zeros(1, dtype=torch.float64)
    if mine > 0:
        expected = mine * totals[present] / nodes
        share[0] = ((counts[present] - expected) ** 2 / expected).sum()
    chi2 = float(reduce(share, "control")[0])
    return skew_from_sums(chi2, int(round(nodes)), ranks, int(present.sum()))
