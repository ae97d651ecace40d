"""Every training strategy, declared once: what the configuration, the planner, the launcher and the
workers need to know about it. No torch import here (the command line reads it to build its
options); a strategy's training functions are imported when a worker runs it.

A new strategy is a module in this package with its training function, one ``StrategySpec`` in
``STRATEGIES`` and its tests: the ``--strategy`` choices, the options that apply to it, the
warm-start, site and partition checks and its code version all follow from the spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StrategySpec:
    """One strategy.

    ``layerwise``: trained layer by layer, one halo exchange per layer (``optional``: only with
    ``--layerwise``); ``whole_graph``: one process over the whole dataset, no partition;
    ``isolated``: the parts train apart without a halo and average their models;
    ``warm_startable``: a run can start from an earlier run's parameters (and so be re-evaluated
    by the promotion gate); ``refreshes_partitions``: trains over a new partition every few epochs
    (built into the store before the launch); ``at_sites``: can train across sites that each keep
    their own store. ``trainer``: ``module:function`` of its end-to-end training (layer-wise
    training runs ``retexo_core.strategies.retexo.train_layer`` per layer). ``modules``: the files
    of this package it runs, which enter its code version.
    """

    name: str
    help: str
    layerwise: bool | str = False  # True, False or "optional"
    whole_graph: bool = False
    isolated: bool = False
    warm_startable: bool = True
    refreshes_partitions: bool = False
    at_sites: bool = False
    trainer: str | None = None
    modules: tuple[str, ...] = ()

    @property
    def end_to_end(self) -> bool:
        """Whether it can train the whole model at once (``optional`` layer-wise ones can)."""
        return self.layerwise is not True

    @property
    def can_train_layerwise(self) -> bool:
        return self.layerwise is not False

    def load_trainer(self) -> Callable[..., Any]:
        """The end-to-end training function: ``trainer(ctx, sink, load_refresh) -> (evaluation
        context, EndToEndResult)``."""
        assert self.trainer is not None, f"{self.name} has no end-to-end trainer"
        module, function = self.trainer.split(":")
        return getattr(importlib.import_module(module), function)


STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec("retexo", "lazy message passing, layer by layer", layerwise=True, at_sites=True,
                 modules=("retexo.py",)),
    StrategySpec("standard", "full-graph distributed; bns_rate < 1 gives BNS-GCN", at_sites=True,
                 trainer="retexo_core.strategies.endtoend:train_model", modules=("endtoend.py",)),
    StrategySpec("centralized", "one process", layerwise="optional", whole_graph=True,
                 trainer="retexo_core.strategies.endtoend:train_model", modules=("retexo.py", "endtoend.py")),
    StrategySpec("varco", "compressed full-graph training", trainer="retexo_core.strategies.endtoend:train_model",
                 modules=("endtoend.py",)),
    StrategySpec("tma", "RandomTMA / SuperTMA: the parts train apart and average their models", isolated=True,
                 warm_startable=False, trainer="retexo_core.strategies.isolated:train_tma_model",
                 modules=("isolated.py",)),
    StrategySpec("grappa", "isolated parts, repartitioned every few epochs", isolated=True, warm_startable=False,
                 refreshes_partitions=True, trainer="retexo_core.strategies.isolated:train_grappa_model",
                 modules=("isolated.py",)),
)}
NAMES = tuple(STRATEGIES)


def spec(name: str) -> StrategySpec:
    return STRATEGIES[name]


def names_where(test: Callable[[StrategySpec], bool]) -> tuple[str, ...]:
    """The names of the strategies whose spec passes ``test``, in registry order."""
    return tuple(s.name for s in STRATEGIES.values() if test(s))


END_TO_END = names_where(lambda s: s.end_to_end)
LAYERWISE = names_where(lambda s: s.can_train_layerwise)  # the options of layer-wise training apply
OPTIONALLY_LAYERWISE = names_where(lambda s: s.layerwise == "optional")  # --layerwise applies
EARLY_STOPPING = names_where(lambda s: not s.isolated)  # validated globally, so --patience applies
WARM_STARTABLE = names_where(lambda s: s.warm_startable)
AT_SITES = names_where(lambda s: s.at_sites)
