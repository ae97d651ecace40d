"""Seeded stratified train/val/test splits for sources without one."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field, model_validator


class SplitFractions(BaseModel):
    """Fractions of the labelled nodes of each class put into train and val; the rest is test."""

    train: float = Field(0.6, gt=0, lt=1, json_schema_extra={"cli": "train_frac"},
                         description="Fraction of each class's labelled nodes for training, when the source has no split.")
    val: float = Field(0.2, ge=0, lt=1, json_schema_extra={"cli": "val_frac"},
                       description="Fraction for validation (the rest is test), when the source has no split.")
    seed: int = Field(0, ge=0, json_schema_extra={"cli": "split_seed"}, description="Seed of the stratified split.")

    @model_validator(mode="after")
    def _fits(self) -> "SplitFractions":
        if self.train + self.val > 1:
            raise ValueError(f"train ({self.train}) + val ({self.val}) fractions exceed 1")
        return self


def stratified_split(label: np.ndarray, fractions: SplitFractions) -> np.ndarray:
    """(N,) labels -> (N,) split names; unlabelled nodes (-1) get ``none``.

    Within each class the nodes are shuffled with ``fractions.seed`` and cut at
    ``round(train * n)`` and ``round((train + val) * n)``.
    """
    rng = np.random.default_rng(fractions.seed)
    split = np.full(label.shape[0], "none", dtype="<U5")
    for cls in np.unique(label[label >= 0]):
        members = rng.permutation(np.flatnonzero(label == cls))
        n_train = int(round(fractions.train * len(members)))
        n_val = int(round((fractions.train + fractions.val) * len(members)))
        split[members[:n_train]] = "train"
        split[members[n_train:n_val]] = "val"
        split[members[n_val:]] = "test"
    return split
