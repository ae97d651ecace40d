"""Training options: the one declaration (pydantic) that the CLI options, the preset keys and the
run and layer fingerprints are all derived from. No torch import here, so the CLI starts fast.

Each field carries its help text and, in ``json_schema_extra``, how it enters the fingerprints:

- ``scope``: ``layer`` (every layer of a layer-wise run depends on it), ``per_layer`` (one value per
  layer; layer l depends on entries 1..l), ``last`` (only the last layer of a layer-wise run), ``run`` (only the run as a whole, e.g. epochs of an
  end-to-end strategy), ``none`` (not part of any result, e.g. a timeout);
- ``strategies``: the strategies the option applies to (absent: all); other strategies leave it
  out of their fingerprints, so changing a VARCO knob never invalidates a Retexo run;
- ``cli``: the command-line name when it is not the field name with dashes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from retexo_core.strategies.registry import (
    EARLY_STOPPING, END_TO_END, LAYERWISE, NAMES, OPTIONALLY_LAYERWISE, STRATEGIES, WARM_STARTABLE, StrategySpec, spec,
)

Strategy = Literal[NAMES]  # type: ignore[valid-type]
ModelName = Literal["gcn", "sage", "gat"]
Compression = Literal["none", "fp16", "int8"]
Scope = Literal["layer", "per_layer", "last", "run", "none"]
LINK_STRATEGIES = ("retexo", "centralized", "standard", "tma")  # the strategies that train --task link
LR = 0.01  # the default learning rate (Adam), as Kipf & Welling
LAYERWISE_FIRST_LR = {"gcn": 0.005}  # layer 1 of layer-wise training, per model (chosen on validation: docs/training.md)
SCARCE_LABELS = 0.1  # joint_fresh is on by default where fewer than this share of the nodes train (docs/accuracy-layerwise.md)


def option(default: Any, help: str, *, scope: Scope, strategies: tuple[str, ...] | None = None,
           cli: str | None = None, **constraints: Any) -> Any:
    """A ``Field`` with its help text and its fingerprint scope (see the module docstring)."""
    extra: dict[str, Any] = {"scope": scope}
    if strategies is not None:
        extra["strategies"] = list(strategies)
    if cli is not None:
        extra["cli"] = cli
    return Field(default, description=help, json_schema_extra=extra, **constraints)


class TrainConfig(BaseModel):
    """What to train and how. Per-layer options (``rounds``, ``lr``) take one value or one per layer."""

    model_config = ConfigDict(extra="forbid")

    strategy: Strategy = option("retexo", " | ".join(f"{s.name} ({s.help})" for s in STRATEGIES.values()) + ".",
                                scope="layer")
    model: ModelName = option("gcn", "gcn | sage | gat.", scope="layer")
    task: Literal["node", "link"] = option(
        "node", "node: classify nodes | link: predict the held-out edges of a link dataset (`retexo ingest link-split`), "
        "scoring node pairs by the dot product of their last-layer embeddings (retexo, centralized, standard and tma; "
        "GCN and SAGE layer-wise, every model end to end).", scope="layer")
    link_dim: int = option(64, "task link: width of the embeddings whose dot products score node pairs (the last "
                           "layer's output; every hidden layer of layer-wise training is trained with a linear "
                           "head to this width).", scope="layer", ge=1)
    recommend: int = option(0, "task link: write each node's best K candidates (a node it has no training edge "
                            "with, scored by the node's owner among the nodes it embeds) to the recommendations "
                            "view; 0: none.", scope="layer", ge=0)
    hits_k: int = option(50, "task link: K of Hits@K (the share of positive pairs scored above the K-th highest "
                         "negative pair of their split).", scope="run", ge=1)
    setting: Literal["transductive", "inductive"] = option(
        "transductive", "transductive | inductive (val/test nodes and their edges unseen in training).", scope="layer")
    normalize_features: Literal["auto", "rows", "none"] = option(
        "auto", "Feature preprocessing: rows (each node's features divided by their sum), none (as the data "
        "gives them), or auto: chosen on validation when the features are non-negative (layer-wise training "
        "trains layer 1 on both from its one halo exchange and keeps the better; end-to-end strategies train "
        "the whole model on both and keep the better).", scope="layer")
    recipe: str = option(
        "auto", "auto: choose the recipe (feature normalisation, skip connection, LayerNorm, weight decay, dropout, "
        "GAT's attention dropout, learning rate) on validation, knob by knob: per layer from its one halo "
        "exchange for layer-wise training, the whole model end to end, for every strategy and task; default: "
        "the configured values (the feature normalisation still chosen under normalize_features auto); or a "
        "recipe file (a searched run's recipe.json).",
        scope="layer")
    recipe_screen: int | None = option(
        None, "recipe auto: rounds each candidate recipe of a layer-wise search trains before the kept one goes on "
        "to the layer's full rounds (default: 50 for task node; 20 for task link, so that the search's gradient "
        "sync stays within the halo traffic it saves). End to end: by default every candidate trains the full "
        "epochs; given, each trains this many and the kept one then trains the full epochs again (fewer epochs "
        "and bytes; 50 mis-ranks on some graphs, see docs/accuracy.md, the baselines' recipe).", scope="layer",
        ge=1)
    recipe_margin: float = option(
        0.0, "recipe search: an alternative replaces the kept recipe only when it classifies more validation nodes "
        "right by more than this many standard errors of that paired difference (sqrt of the nodes the two "
        "disagree on); 0: any higher validation accuracy. ROC-AUC (two classes) and link scores: any higher "
        "score. See docs/accuracy-search.md, the search margin.", scope="layer", ge=0)
    layers: int = option(2, "Number of GNN layers.", scope="run", ge=1, le=8)
    choose_depth: bool | None = option(
        None, "Also train the model one layer deeper (layers + 1) and keep the depth with the higher validation "
        "score (the shallower on ties). Layer-wise training reuses the first layers - 1 layers from the store; an "
        "end-to-end strategy trains the whole model again. Both runs stay in the store; the choice's bytes are "
        "both runs' traffic, shared layers once. Default (neither flag): on with recipe auto for task node, "
        "layer-wise strategies and centralized, when layers is at most 7, rounds and lr have one value, and "
        "without warm start or sites; off otherwise. See docs/training.md, the depth.", scope="none")
    hidden: int = option(256, "Hidden size.", scope="layer", ge=1)
    heads: int = option(4, "GAT attention heads.", scope="layer", ge=1)
    dropout: float = option(0.5, "Dropout rate (layer-wise training: on the aggregated inputs of a layer; "
                            "end-to-end: on every block's input).", scope="layer", ge=0, lt=1)
    attention_dropout: float = option(
        0.0, "GAT: dropout rate on the attention coefficients (PyG's GAT example drops them at its dropout "
        "rate; off by default: it lost validation accuracy on two graphs of the development suite).",
        scope="layer", ge=0, lt=1)
    weight_decay: float = option(5e-4, "Adam weight decay.", scope="layer", ge=0)
    weight_decay_layers: Literal["first", "all"] = option(
        "first", "Layers whose parameters get the weight decay: first (Kipf & Welling) or all.", scope="layer")
    norm: Literal["none", "layer"] = option(
        "none", "Normalisation in hidden blocks: none (conv -> ReLU) or layer (conv -> LayerNorm -> ReLU).",
        scope="layer")
    skip: bool = option(False, "GCN / GAT blocks: add a linear transform of the node's own input row to the conv "
                        "(a skip connection, like SAGE's root weight; no extra traffic).", scope="layer")
    patience: int | None = option(None, "Early stopping: stop a layer (or an end-to-end run) when validation "
                                  "accuracy has not improved for this many rounds or epochs; none = never.",
                                  scope="layer", strategies=EARLY_STOPPING, ge=1)
    rounds: int | list[int] = option(200, "Layer-wise training: rounds per layer, one value or one per layer "
                                     "(comma list on the command line); 0 only with warm_start.", scope="per_layer",
                                     strategies=LAYERWISE)
    joint_rounds: int | None = option(
        None, "Layer-wise training (task node, transductive, full batch): after the last layer, train the last "
        "two layers together for this many rounds from their greedy parameters, from one more halo exchange (GCN / "
        "SAGE: layer L-1's aggregated inputs of the halo nodes; GAT: the halo nodes' in-edges and their sources' "
        "inputs) and the usual gradient sync or averaging; the pair replaces the greedy model only where it scores "
        "higher on validation. Default: the last layer's rounds for GCN and SAGE, and for GAT where fewer than "
        f"{SCARCE_LABELS:.0%} of the nodes are in the train split (scarce labels; off elsewhere and at sites). 0: off. See "
        "docs/training.md, the last two layers together.", scope="last", strategies=LAYERWISE, ge=0)
    joint_fresh: bool | None = option(
        None, "With the last two layers trained together (joint_rounds): then also train the pair from the layers' "
        "initial parameters for as many rounds, both with layer L-1's dropout, learning rate and weight decay (and "
        "layer L's skip connection held at zero where layer L-1 has none): end-to-end training of the last two "
        "layers on layer L-1's greedy inputs. Keeps whichever of the greedy model, the pair trained on from it and "
        "the fresh pair scores highest on validation. Doubles the pair's rounds and gradient sync; no more halo "
        f"traffic. Default: on where fewer than {SCARCE_LABELS:.0%} of the nodes are in the train split (scarce "
        "labels), off otherwise and at sites. See docs/training.md, the last two layers together.",
        scope="last", strategies=LAYERWISE)
    batch_size: int | None = option(None, "Layer-wise training: train nodes per step (a round is one pass over "
                                    "a rank's train nodes; exact, no sampling); none = full batch.", scope="layer",
                                    strategies=LAYERWISE, ge=1)
    lr: float | list[float] | None = option(
        None, f"Learning rate, one value or one per layer (comma list); default {LR}, except layer 1 of layer-wise "
        f"GCN: {LAYERWISE_FIRST_LR['gcn']} (see docs/training.md, the default recipe).", scope="per_layer")
    epochs: int = option(200, "Epochs (steps) of the end-to-end strategies (0 only with warm_start: evaluate "
                         "the warm-start model as it is).", scope="run", strategies=END_TO_END, ge=0)
    seed: int = option(0, "Training seed, 0 to 2^32-1 (the seeds derived from it, seed x 1000 + layer + "
                       "7919 x (rank + 1), stay inside torch's range, at most 2^64-1).", scope="layer", ge=0,
                       le=2**32 - 1)
    sync: Literal["grad", "avg"] = option("grad", "retexo: grad (sum gradients every round) or avg (local steps, "
                                          "model averaging every sync_every rounds).", scope="layer",
                                          strategies=("retexo",))
    sync_every: int = option(1, "retexo --sync avg: rounds between averagings.", scope="layer",
                             strategies=("retexo",), ge=1)
    drift_correction: bool | None = option(
        None, "retexo --sync avg: correct each rank's local steps by the gap between the global and its own "
        "gradient at the last averaged model (SCAFFOLD's control variates, from full local gradients), for parts "
        "whose labels differ (sites, METIS). One more all-reduce of the parameters (grad_sync) per averaging and "
        "one at the start. Default (neither flag): on where the ranks' train labels differ (a chi-square test of "
        "rank against label, p < 0.001 and Cramer's V >= 0.1, from two all-reduces of class counts; task node), "
        "off otherwise. See docs/training.md, drift correction for model averaging.", scope="layer",
        strategies=("retexo",))
    compress: Compression = option("none", "Encoding of everything sent except control traffic: none | fp16 | "
                                   "int8.", scope="layer")
    skip_zero_grads: bool = option(False, "Gradient sync: send each all-reduce chunk as a bitmap of its non-zero "
                                   "entries plus those entries when that is shorter (lossless; the lengths go "
                                   "first, 8 B to each peer as control). Only with --compress none.", scope="layer")
    secure_agg: bool = option(False, "Sites (retexo site train with --kit, 3 sites or more): sum gradients and "
                              "models under pairwise masks that cancel in the sum, in fixed point (2^-32), so that "
                              "no site sees another's (secure aggregation; twice the sync bytes). Only with "
                              "--compress none.", scope="layer")
    bns_rate: float = option(1.0, "standard: fraction of boundary nodes sampled per epoch (BNS-GCN).", scope="run",
                             strategies=("standard",), gt=0, le=1)
    eval_every: int = option(5, "Rounds (layer-wise) or epochs (end-to-end) between validation passes; the "
                             "parameters with the best validation accuracy are kept. The last two layers trained "
                             "together validate every round with gradient sync.", scope="layer", ge=1)
    layerwise: bool = option(False, "centralized: train layer by layer like Retexo.", scope="layer",
                             strategies=OPTIONALLY_LAYERWISE)
    varco_c_max: float = option(8.0, "varco: compression ratio at the first epoch.", scope="run",
                                strategies=("varco",), ge=1)
    varco_c_min: float = option(1.0, "varco: compression ratio at the last epoch.", scope="run",
                                strategies=("varco",), ge=1)
    varco_schedule: Literal["linear", "fixed"] = option("linear", "varco: linear (c_max -> c_min) or fixed (c_max "
                                                        "throughout).", scope="run", strategies=("varco",))
    agg_every_steps: int = option(10, "tma: average the models every this many steps.", scope="run",
                                  strategies=("tma",), ge=1)
    agg_every_seconds: float | None = option(None, "tma: average every this many seconds instead.", scope="run",
                                             strategies=("tma",), gt=0)
    tolerate_failures: bool = option(False, "tma: drop a dead trainer from the average and go on.", scope="run",
                                     strategies=("tma",))
    grappa_refresh_every: int = option(50, "grappa: epochs between repartitionings.", scope="run",
                                       strategies=("grappa",), ge=1)
    grappa_shrinkage: float = option(0.0, "grappa: shrink coverage weights towards uniform (0..1).", scope="run",
                                     strategies=("grappa",), ge=0, le=1)
    warm_start: str | None = option(
        None, "Start every layer from the parameters of this earlier completed run (fingerprint or unique prefix; "
        "same model, layers, hidden size, features and classes). With patience, fewer rounds are trained.",
        scope="layer", strategies=WARM_STARTABLE)
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "Where each rank computes: cpu, cuda (the machine's GPUs, ranks spread over them round robin; several "
        "ranks may share one) or auto (cuda when torch sees a GPU, else cpu). Not part of any fingerprint: the bytes "
        "sent are the same and the results agree within float tolerance, so a run trained on one device is "
        "reused on the other.", scope="none")
    force: bool = option(False, "Start even when the memory estimate exceeds the memory available now.",
                         scope="none")
    timeout_s: float = option(300.0, "Seconds a rank may wait for its peers in one collective (or for the "
                              "process group to form) before the run fails; long, so that a slow but working "
                              "rank is waited for (a stopped one is caught by the hang timeout).", scope="none",
                              cli="timeout", gt=0)
    hang_timeout_s: float = option(20.0, "Seconds a worker process may show no sign of life (no heartbeat and "
                                   "no CPU time) before the launcher stops the run and names it as hung.",
                                   scope="none", cli="hang-timeout", ge=2)

    @field_validator("lr")
    @classmethod
    def _positive(cls, value: float | list[float] | None) -> float | list[float] | None:
        if value is None:
            return value
        values = value if isinstance(value, list) else [value]
        if not values or any(v <= 0 for v in values):
            raise ValueError("must be positive (one value, or one per layer)")
        return value

    @field_validator("recipe", mode="before")
    @classmethod
    def _recipe(cls, value: Any) -> str:
        """auto, default, or a recipe (a file's path, a JSON object or its text) kept as canonical
        JSON text, so that the fingerprints follow its content, not its path."""
        from retexo_core.recipe import checked_recipe, read_recipe_file  # the recipe module reads this one

        if value in ("auto", "default"):
            return value
        if isinstance(value, dict):
            layers = checked_recipe(value, "recipe")
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            layers = checked_recipe(json.loads(value), "recipe")
        elif isinstance(value, str) and value:
            layers = read_recipe_file(Path(value))
        else:
            raise ValueError("expected auto, default or a recipe file")
        return json.dumps({"layers": {str(k): layers[k] for k in sorted(layers)}}, sort_keys=True)

    @field_validator("rounds")
    @classmethod
    def _non_negative(cls, value: int | list[int]) -> int | list[int]:
        values = value if isinstance(value, list) else [value]
        if not values or any(v < 0 for v in values):
            raise ValueError("must be non-negative (one value, or one per layer)")
        return value

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        for name in ("rounds", "lr"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.layers:
                raise ValueError(f"{name} has {len(value)} entries but layers = {self.layers}")
        if self.varco_c_min > self.varco_c_max:
            raise ValueError(f"varco_c_min ({self.varco_c_min}) must not exceed varco_c_max ({self.varco_c_max})")
        if self.skip_zero_grads and self.compress != "none":
            raise ValueError("skip_zero_grads is a lossless encoding of uncompressed gradients: use it with "
                             "compress none")
        if self.secure_agg and (self.compress != "none" or self.skip_zero_grads):
            raise ValueError("secure_agg sums masked fixed-point values: use it with compress none and without "
                             "skip_zero_grads")
        if self.drift_correction and self.sync != "avg":
            raise ValueError("drift_correction corrects the local steps of model averaging: use it with sync avg")
        if self.tolerate_failures and self.strategy != "tma":
            raise ValueError("tolerate_failures is supported by the tma strategy only")
        rounds = self.rounds if isinstance(self.rounds, list) else [self.rounds]
        if self.warm_start is None and (self.epochs == 0 or 0 in rounds):
            raise ValueError("rounds / epochs = 0 (evaluate without training) needs warm_start")
        if self.warm_start is not None and self.strategy not in WARM_STARTABLE:
            raise ValueError(f"warm_start is supported by {', '.join(WARM_STARTABLE)}, not {self.strategy}")
        if self.task == "link":
            self._check_link()
        if self.choose_depth and (misfit := self._two_depths_misfit()):
            raise ValueError(misfit)
        if self.model == "gat" and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}) for GAT")
        return self

    def _two_depths_misfit(self) -> str | None:
        """Why this configuration cannot train two depths (None: it can): ``choose_depth`` needs room
        for one more layer, options that fit both depths and no warm start (its parameters fit one)."""
        if self.layers >= 8:
            return "choose_depth trains layers + 1 too: layers must be at most 7"
        if isinstance(self.rounds, list) or isinstance(self.lr, list):
            return "choose_depth trains two depths: give rounds and lr one value each, not one per layer"
        if self.warm_start is not None:
            return "choose_depth trains two depths, and a warm start fits one: drop warm_start or choose_depth"
        return None

    @property
    def chooses_depth(self) -> bool:
        """Whether a run of this configuration also trains the run one layer deeper: ``choose_depth``
        when given, else on where the recipe is searched in full (recipe auto, task node, layer-wise or
        centralized) and the configuration fits two depths."""
        if self.choose_depth is not None:
            return self.choose_depth
        searched = self.recipe == "auto" and self.task == "node" and (self.is_layerwise or self.strategy == "centralized")
        return searched and self._two_depths_misfit() is None

    def at_depth(self, layers: int) -> "TrainConfig":
        """This configuration with ``layers`` layers, one depth (no ``choose_depth``)."""
        return self.model_copy(update={"layers": layers, "choose_depth": False})

    def deeper(self) -> "TrainConfig":
        """This configuration one layer deeper, without the choice."""
        return self.at_depth(self.layers + 1)

    def _check_link(self) -> None:
        """What the link task supports so far (each a one-line refusal)."""
        if self.strategy not in LINK_STRATEGIES:
            raise ValueError(f"task link is trained by {', '.join(LINK_STRATEGIES)}, not {self.strategy}")
        if self.is_layerwise and self.model == "gat":
            raise ValueError("task link: layer-wise GAT is not supported (its attention needs the partner's "
                             "neighbours); use gcn or sage, or centralized end to end")
        if self.setting != "transductive" or self.batch_size is not None or self.secure_agg:
            raise ValueError("task link: trains transductively, full batch, without secure_agg")

    def per_layer(self, name: str, layer: int) -> Any:
        """Layer ``layer``'s (1-based) value of a per-layer option (the default learning rate
        resolved when ``lr`` is not set)."""
        value = getattr(self, name)
        if name == "lr" and value is None:
            return LAYERWISE_FIRST_LR.get(self.model, LR) if self.is_layerwise and layer == 1 else LR
        return value[layer - 1] if isinstance(value, list) else value

    @property
    def fixed_recipe(self) -> dict[int, dict[str, Any]] | None:
        """Layer -> knob values of a recipe file (None for auto and default)."""
        if self.recipe in ("auto", "default"):
            return None
        return {int(k): v for k, v in json.loads(self.recipe)["layers"].items()}

    @property
    def screen_rounds(self) -> int:
        """Rounds each recipe candidate of a layer-wise search trains before the next one."""
        if self.recipe_screen is not None:
            return self.recipe_screen
        return 20 if self.task == "link" else 50

    @property
    def screen_epochs(self) -> int | None:
        """Epochs each candidate of an end-to-end recipe search trains before the kept one trains
        ``epochs`` from the start again: ``recipe_screen`` where it is given and shorter than
        ``epochs``; None (every candidate trains ``epochs``) otherwise."""
        if self.recipe_screen is None or self.recipe_screen >= self.epochs:
            return None
        return self.recipe_screen

    def layer_rounds(self, layer: int) -> int:
        return int(self.per_layer("rounds", layer))

    def layer_lr(self, layer: int) -> float:
        return float(self.per_layer("lr", layer))

    @property
    def uses_norm(self) -> bool:
        return self.norm == "layer"

    def decays_layer(self, layer: int) -> bool:
        return self.weight_decay_layers == "all" or layer == 1

    @property
    def last_two_rounds(self) -> int:
        """Rounds of the last two layers together: ``joint_rounds``, or the last layer's rounds (GCN
        and SAGE; GAT's pair trains only when ``joint_rounds`` is set, which planning does where
        labels are scarce: ``runner.plan.resolve_joint``)."""
        if self.joint_rounds is not None:
            return self.joint_rounds
        return 0 if self.model == "gat" else self.layer_rounds(self.layers)

    @property
    def trains_jointly(self) -> bool:
        """Whether the last two layers train together after the greedy layers
        (``strategies/joint.py``): ``last_two_rounds`` > 0, layer-wise with two layers or more, task
        node, transductive, full batch, over a halo (not the isolated strategies)."""
        return (self.last_two_rounds > 0 and self.is_layerwise and self.layers >= 2
                and self.task == "node" and self.setting == "transductive" and self.batch_size is None
                and not self.strategy_spec.isolated)

    @property
    def strategy_spec(self) -> StrategySpec:
        return spec(self.strategy)

    @property
    def is_layerwise(self) -> bool:
        layerwise = self.strategy_spec.layerwise
        return layerwise is True or (layerwise == "optional" and self.layerwise)

    def _fields(self, scopes: set[str]) -> list[str]:
        """Names of the fields with one of ``scopes`` that apply to this run's strategy."""
        names = []
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra or {}
            applies = self.strategy in extra.get("strategies", [self.strategy])  # type: ignore[operator]
            if extra.get("scope") in scopes and applies:
                names.append(name)
        return names

    def layer_payload(self, layer: int) -> dict[str, object]:
        """What determines layer ``layer`` of a layer-wise run: shared options and layers 1..layer."""
        per_layer = {name: [self.per_layer(name, k) for k in range(1, layer + 1)]
                     for name in self._fields({"per_layer"})}
        last = layer == self.layers
        shared = self._fields({"layer", "last"} if last else {"layer"})
        return {**{k: getattr(self, k) for k in shared}, **per_layer, "last": last}

    def run_payload(self) -> dict[str, object]:
        """Everything that determines a run's results (the run fingerprint), options as given; an
        unset ``lr`` as its resolved value (one number when every layer has the same)."""
        payload = {k: getattr(self, k) for k in self._fields({"layer", "per_layer", "last", "run"})}
        if self.lr is None:
            rates = [self.layer_lr(k) for k in range(1, self.layers + 1)]
            payload["lr"] = rates[0] if len(set(rates)) == 1 else rates
        return payload


def cli_name(model: type[BaseModel], field: str) -> str:
    """The command-line option name of a field (``timeout_s`` -> ``timeout``)."""
    extra = model.model_fields[field].json_schema_extra or {}
    return str(extra.get("cli", field))  # type: ignore[union-attr]
