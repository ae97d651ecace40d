"""Classification metrics from confusion matrices (which sum across workers) and binary ROC-AUC."""

from __future__ import annotations

import numpy as np
import torch


def confusion(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C, C) float64 counts, rows = true class, columns = predicted, over nodes in ``mask``."""
    keep = mask & (y >= 0)
    pred = logits[keep].argmax(dim=1)
    flat = y[keep] * num_classes + pred
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes).double()


def accuracy(matrix: np.ndarray) -> float:
    total = matrix.sum()
    return float(np.trace(matrix) / total) if total else float("nan")


def macro_f1(matrix: np.ndarray) -> float:
    """Mean F1 over classes that occur (as truth or prediction) in ``matrix``."""
    tp = np.diag(matrix)
    support = matrix.sum(axis=1)
    predicted = matrix.sum(axis=0)
    present = (support + predicted) > 0
    if not present.any():
        return float("nan")
    f1 = np.where(present, 2 * tp / np.maximum(support + predicted, 1e-12), 0.0)
    return float(f1[present].mean())


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Binary ROC-AUC: probability that a positive outranks a negative (ties count half)."""
    positives = labels == 1
    n_pos, n_neg = int(positives.sum()), int((labels == 0).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - counts + (counts + 1) / 2)[inverse]  # 1-based, ties averaged
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def link_ranks(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """(P,) float64 rank of each positive score among all negative scores of the same split:
    1 + the negatives scoring higher + half of those scoring the same (ties averaged)."""
    neg = np.sort(np.asarray(neg, np.float64))
    pos = np.asarray(pos, np.float64)
    higher = len(neg) - np.searchsorted(neg, pos, side="right")
    ties = np.searchsorted(neg, pos, side="right") - np.searchsorted(neg, pos, side="left")
    return 1.0 + higher + ties / 2.0


def mean_reciprocal_rank(pos: np.ndarray, neg: np.ndarray) -> float:
    """Mean over the positives of 1 / their rank among the split's negatives (``link_ranks``)."""
    return float(np.mean(1.0 / link_ranks(pos, neg))) if len(pos) else float("nan")


def hits_at_k(pos: np.ndarray, neg: np.ndarray, k: int) -> float:
    """OGB's Hits@K: the fraction of positives scoring strictly above the K-th highest negative
    (every positive counts when there are fewer than K negatives)."""
    if not len(pos):
        return float("nan")
    if len(neg) < k:
        return 1.0
    kth = np.partition(np.asarray(neg, np.float64), len(neg) - k)[len(neg) - k]
    return float(np.mean(np.asarray(pos, np.float64) > kth))


def score_histogram(scores: torch.Tensor, labels: torch.Tensor, bins: int, clip: float) -> torch.Tensor:
    """(2, bins) float64 counts of the negatives' (label 0) and positives' (label 1) scores,
    clipped to ±``clip`` and cut into ``bins`` equal bins (the input of ``histogram_auc``)."""
    clipped = scores.double().clamp(-clip, clip)
    index = ((clipped + clip) * (bins / (2 * clip))).long().clamp(max=bins - 1)
    return torch.stack([torch.bincount(index[labels == c], minlength=bins).double() for c in (0, 1)])


def histogram_auc(counts: np.ndarray) -> float:
    """ROC-AUC from (2, B) negative / positive counts per score bin: a positive outranks the
    negatives of lower bins and ties half of those in its bin (exact up to ties within a bin)."""
    negatives, positives = counts
    below = np.cumsum(negatives) - negatives
    pairs = negatives.sum() * positives.sum()
    return float((positives * (below + negatives / 2)).sum() / pairs) if pairs else float("nan")
