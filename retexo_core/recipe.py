"""The training recipe chosen per graph on validation (``--recipe auto``), or read from a file.

A recipe is the few knobs that decide how well a GNN fits a given graph:

=================  ====================================  ===============================
knob               values tried (the start value first)  config fields it sets
=================  ====================================  ===============================
``features``       ``none`` / ``rows``                   ``normalize_features``
``skip``           off / on (GCN, GAT)                   ``skip``
``norm``           ``none`` / ``layer``                  ``norm``
``decay``          whether this layer gets weight decay  ``weight_decay``, ``weight_decay_layers``
``dropout``        0.5 / 0.2                             ``dropout``
``attention``      0 / 0.5 (GAT)                         ``attention_dropout``
``lr``             0.01 / 0.005                          ``lr``
=================  ====================================  ===============================

The search is greedy, one knob after the other in that order (coordinate ascent; layer-wise training
tries ``skip`` first, before ``features``): the start recipe is the configured one; each alternative
value of a knob trains from the same initial parameters with every other knob at its best value so
far, and replaces it when it classifies more validation nodes right, by more than
``--recipe-margin`` standard errors of that paired difference (``GreedySearch.replaces``; the
default margin 0 takes any higher accuracy, and the earlier candidate wins ties). Layer-wise
training searches every layer on its own, from the inputs of its single halo exchange, so the search
costs rounds (gradient sync and validation), never halo traffic; an end-to-end model is searched as
a whole, each candidate a whole training (or ``--recipe-screen`` epochs of one,
``TrainConfig.screen_epochs``); strategies that validate on their local graphs (TMA, Grappa) are
judged on the full graph's validation (``stages.train_candidates``).
``features`` is only searched on layer 1 with ``--normalize-features auto`` and non-negative
features; ``norm`` is not searched for the last layer (it has none), ``skip`` not for SAGE (its root
weight is one) nor on layer 1 of layer-wise link training (a root weight on the raw features doubles
the widest layer's gradient sync, which put retexo's bytes above ``standard``'s on the suite's
graphs), ``attention`` (dropout of the attention coefficients, as PyG's GAT example has it) only for
GAT, and neither under a warm start (the parameters must fit); layer 1 of layer-wise training always
keeps its weight decay.

A recipe file (``--recipe FILE``) is what a searched run stores as ``recipe.json``: ``{"layers":
{"1": {knob: value, ...}, "2": {...}}}``; an end-to-end run reads layer 1's entry.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retexo_core.config import TrainConfig

KNOBS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("features", ("none", "rows")),
    ("skip", (False, True)),
    ("norm", ("none", "layer")),
    ("decay", (True, False)),  # layer-wise: this layer decays; end to end: "first" / "all" layers
    ("dropout", (0.5, 0.2)),
    ("attention", (0.0, 0.5)),
    ("lr", (0.01, 0.005)),
)
KNOB_NAMES = tuple(name for name, _ in KNOBS)


def knobs_of(config: TrainConfig, layer: int, end_to_end: bool) -> dict[str, Any]:
    """The values ``config`` gives the knobs for layer ``layer`` (``features``: none under auto)."""
    return {"features": "rows" if config.normalize_features == "rows" else "none", "skip": config.skip,
            "norm": config.norm,
            "decay": config.weight_decay_layers if end_to_end else config.decays_layer(layer),
            "dropout": config.dropout, "attention": config.attention_dropout, "lr": config.layer_lr(layer)}


def apply_knobs(config: TrainConfig, layer: int, knobs: dict[str, Any], end_to_end: bool) -> TrainConfig:
    """``config`` with ``knobs`` set for layer ``layer`` (a layer-wise candidate's other layers do
    not matter: only layer ``layer`` trains with it)."""
    values = {**knobs_of(config, layer, end_to_end), **knobs}
    update: dict[str, Any] = {"normalize_features": values["features"], "skip": bool(values["skip"]),
                              "norm": values["norm"],
                              "dropout": float(values["dropout"]), "attention_dropout": float(values["attention"]),
                              "lr": float(values["lr"])}
    if end_to_end:
        update["weight_decay_layers"] = values["decay"]
    else:
        update.update(weight_decay=config.weight_decay if values["decay"] else 0.0, weight_decay_layers="all")
    return config.model_copy(update=update)


@dataclass(frozen=True)
class Candidate:
    """One recipe the search trains: its knob values."""

    knobs: dict[str, Any]

    def describe(self) -> dict[str, Any]:
        return dict(self.knobs)


def searched_knobs(config: TrainConfig, layer: int, *, nonnegative: bool, full: bool, end_to_end: bool) -> list[str]:
    """The knobs searched for layer ``layer``: ``features`` where it can differ; the rest only
    with ``full`` (``--recipe auto`` where a whole search applies)."""
    names = []
    if layer == 1 and config.normalize_features == "auto" and nonnegative:
        names.append("features")
    if full:
        last = layer == config.layers
        structural = config.warm_start is not None  # the warm-start parameters must fit the block
        link_layerwise = config.task == "link" and not end_to_end  # a layer-1 root weight doubles its gradient sync
        names += [n for n in KNOB_NAMES[1:] if not (n == "norm" and (last or structural))
                  and not (n == "skip" and (config.model == "sage" or structural or (link_layerwise and layer == 1)))
                  and not (n == "attention" and config.model != "gat")]
    if not end_to_end and "skip" in names:
        # Layer-wise, ``skip`` goes first: without it layer 1 (one conv and a head) classifies a node
        # from its neighbours alone, and on heterophilous graphs that model picks input features that
        # the block with its skip connection would not (docs/accuracy-layerwise.md, "The order of the
        # layer-wise search's knobs").
        names.insert(0, names.pop(names.index("skip")))
    return names


def search_for(config: TrainConfig, layer: int, *, end_to_end: bool, nonnegative: bool) -> "GreedySearch":
    """The candidates of layer ``layer`` (layer 1 stands for a whole end-to-end model): a recipe
    file's entry as the one candidate; under ``--recipe auto`` every knob, for every strategy and
    task; under ``default`` the features alone (``--normalize-features auto``)."""
    start = knobs_of(config, layer, end_to_end)
    fixed = config.fixed_recipe
    if fixed is not None:
        return GreedySearch({**start, **fixed.get(layer, {})}, [], layer=layer, end_to_end=end_to_end)
    names = searched_knobs(config, layer, nonnegative=nonnegative, full=config.recipe == "auto", end_to_end=end_to_end)
    return GreedySearch(start, names, layer=layer, end_to_end=end_to_end, margin=config.recipe_margin)


def alternatives(name: str, current: Any, *, layer: int, end_to_end: bool) -> list[Any]:
    """The values of knob ``name`` to try besides ``current``."""
    values = ("first", "all") if name == "decay" and end_to_end else dict(KNOBS)[name]
    if name == "decay" and layer == 1 and not end_to_end:
        return []  # layer 1 keeps its weight decay (Kipf & Welling)
    return [v for v in values if v != current]


class GreedySearch:
    """The greedy knob-by-knob search of one layer (or one end-to-end model).

    ``next()`` gives the next candidate to train (None when done); ``report(score, paired)`` its
    validation score and how it compares with the kept one node by node. ``best`` is the recipe
    kept so far, ``tried`` every candidate, score and comparison. ``margin``: in standard errors
    (``replaces``)."""

    def __init__(self, start: dict[str, Any], names: list[str], *, layer: int, end_to_end: bool,
                 margin: float = 0.0):
        self.plan: list[tuple[str, Any]] = [(n, v) for n in names
                                            for v in alternatives(n, start[n], layer=layer, end_to_end=end_to_end)]
        self.margin = margin
        self.best = Candidate(dict(start))
        self.best_score = -float("inf")
        self.tried: list[tuple[Candidate, float, tuple[int, int] | None]] = []
        self._pending: Candidate | None = self.best
        self._step = 0

    @property
    def size(self) -> int:
        """How many candidates the search trains in all (the start included)."""
        return 1 + len(self.plan)

    def next(self) -> Candidate | None:
        if self._pending is not None:
            return self._pending
        if self._step >= len(self.plan):
            return None
        name, value = self.plan[self._step]
        self._step += 1
        self._pending = Candidate({**self.best.knobs, name: value})
        return self._pending

    def report(self, score: float, paired: tuple[int, int] | None = None) -> bool:
        """Record the pending candidate's best validation score and, where that is an accuracy,
        ``paired``: (gained, lost), the validation nodes it classifies right and the kept one
        wrong, and the reverse (``common.paired_counts``; None for the first candidate). True
        when it is the new best."""
        candidate, self._pending = self._pending, None
        assert candidate is not None
        self.tried.append((candidate, score, paired))
        if len(self.tried) == 1 or self.replaces(score, paired):
            self.best, self.best_score = candidate, score
            return True
        return False

    def replaces(self, score: float, paired: tuple[int, int] | None) -> bool:
        """Whether a candidate replaces the kept one: by accuracy, when it classifies more
        validation nodes right by more than ``margin`` standard errors of that paired difference,
        gained - lost > margin * sqrt(gained + lost) (McNemar's statistic; with margin 0, any
        higher accuracy); by another score (ROC-AUC, the link task's), when it is higher."""
        if paired is None:
            return score > self.best_score
        gained, lost = paired
        return gained - lost > self.margin * math.sqrt(gained + lost)

    def choice(self) -> dict[str, Any]:
        """What the layer manifest stores: the knobs the kept model trained with and, after a
        search, every candidate's validation score (and its paired counts against the recipe
        kept when it trained) in the order they trained."""
        if len(self.tried) < 2:
            return self.best.describe()
        return {**self.best.describe(),
                "val_scores": [{**c.describe(), "val": s, **({} if p is None else {"gained": p[0], "lost": p[1]})}
                               for c, s, p in self.tried]}


def run_recipe(layer_choices: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A run's ``recipe.json`` (what ``--recipe FILE`` reads) from its layers' stored choices."""
    return {"layers": {str(layer): {k: v for k, v in choice.items() if k in KNOB_NAMES}
                       for layer, choice in sorted(layer_choices.items()) if choice}}


def read_recipe_file(path: Path) -> dict[int, dict[str, Any]]:
    """Layer -> knob values of a recipe file; a bad file raises ``ValueError`` naming the file
    and the field."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: recipe file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON recipe file ({error})") from None
    return checked_recipe(raw, str(path))


def checked_recipe(raw: Any, where: str) -> dict[int, dict[str, Any]]:
    """Layer -> knob values of a recipe object ``{"layers": {...}}``; ``ValueError`` naming
    ``where`` and the field when it is not one."""
    path = where  # the file, or "recipe" for an inline object
    layers = raw.get("layers") if isinstance(raw, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f'{path}: expected {{"layers": {{"1": {{knob: value}}, ...}}}}')
    recipe = {}
    for key, knobs in layers.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"{path}: layers.{key}: expected a layer number from 1")
        if not isinstance(knobs, dict):
            raise ValueError(f"{path}: layers.{key}: expected an object of knob values")
        for name, value in knobs.items():
            if name not in KNOB_NAMES:
                raise ValueError(f"{path}: layers.{key}.{name}: unknown knob (expected one of {', '.join(KNOB_NAMES)})")
            if not valid_value(name, value):
                raise ValueError(f"{path}: layers.{key}.{name}: {value!r} is not a valid value")
        recipe[int(key)] = dict(knobs)
    return recipe


def valid_value(name: str, value: Any) -> bool:
    if name == "features":
        return value in ("none", "rows")
    if name == "norm":
        return value in ("none", "layer")
    if name in ("decay", "skip"):
        return isinstance(value, bool) or (name == "decay" and value in ("first", "all"))
    if name in ("dropout", "attention"):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
