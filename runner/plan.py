"""A run's plan: its fingerprint, its layers' fingerprints, and where its inputs are.

A run is ``runs/run=<rfp>/``; its layers are folders ``layer=<l>/`` keyed (in their manifests) by a
layer fingerprint = source (partition or dataset) fp + the options of layers 1..l + the
strategy's code version (``code_version``). End-to-end strategies produce all layers in one launch; their layer
fingerprint covers the whole configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Literal

from graphstore.errors import RetexoError, StoreError
from graphstore.fingerprint import file_digest, fingerprint, tree_digest
from graphstore.layout import Store
from graphstore.lookup import DatasetRef, PartitionRef, completed_run, find_dataset, find_layer, layer_fp_of
from retexo_core.comm.network import NetworkModel
from retexo_core.config import SCARCE_LABELS, TrainConfig
from retexo_core.strategies.registry import AT_SITES, STRATEGIES, spec

REPO = Path(__file__).resolve().parents[1]


@cache
def code_version(strategy: str) -> str:
    """The code a run of ``strategy`` depends on: ``retexo_core`` without the other strategies'
    modules (``StrategySpec.modules``), and ``runner/results.py``, which writes its outputs."""
    mine = {f"strategies/{m}" for m in spec(strategy).modules}
    others = frozenset(f"strategies/{m}" for s in STRATEGIES.values() for m in s.modules) - mine
    return fingerprint({"core": tree_digest(REPO / "retexo_core", skip=others),
                        "results": file_digest(REPO / "runner" / "results.py")})


LayerState = Literal["done", "reusable", "pending"]


@dataclass(frozen=True)
class RunPlan:
    """Everything needed to train and finalise one run (small and picklable)."""

    store_root: str
    run_fp: str
    dataset_name: str
    dataset_fp: str
    partition_fp: str | None
    partition_method: str | None
    source_dir: str  # the partition folder, or the dataset folder for centralized runs
    whole_graph: bool
    world: int
    config: TrainConfig
    network: NetworkModel
    layer_fps: dict[int, str] = field(default_factory=dict)
    site: int | None = None  # a site's run: this site's rank (world = the number of sites)
    deeper: "RunPlan | None" = None  # choose_depth: the run one layer deeper, trained after this one

    @property
    def store(self) -> Store:
        return Store(Path(self.store_root))

    @property
    def layers(self) -> list[int]:
        return list(range(1, self.config.layers + 1))

    def layer_dir(self, layer: int) -> Path:
        return self.store.layer_dir(self.run_fp, layer)


def resolve_warm_start(store: Store, dataset: DatasetRef, config: TrainConfig) -> TrainConfig:
    """``config`` with ``warm_start`` as the full fingerprint of a completed run whose parameters
    fit this run (same model, layers, hidden size and heads, same kind of training, and a dataset
    with as many features and classes); ``StoreError`` naming the mismatch otherwise. The run
    trains with the recipe the warm-start run kept (its blocks have that recipe's shape: a skip
    connection, a LayerNorm), as a recipe file would give it."""
    if config.warm_start is None:
        return config
    warm = completed_run(store, config.warm_start)
    base = TrainConfig.model_validate(warm.config)
    source = find_dataset(store, warm.dataset)
    checks = {
        "model": (base.model, config.model), "layers": (base.layers, config.layers),
        "hidden": (base.hidden, config.hidden),
        "heads": (base.heads, config.heads) if config.model == "gat" else (0, 0),
        "layer-wise training": (base.is_layerwise, config.is_layerwise), "norm": (base.norm, config.norm),
        "features": (source.num_features, dataset.num_features), "classes": (source.num_classes, dataset.num_classes),
    }
    for name, (theirs, ours) in checks.items():
        if theirs != ours:
            raise StoreError(f"--warm-start {config.warm_start}: run {warm.fp} has {name} {theirs}, this run {ours}")
    update: dict[str, object] = {"warm_start": warm.fp}
    if warm.recipe.get("layers"):
        update["recipe"] = TrainConfig(recipe=warm.recipe).recipe  # its canonical form
    return config.model_copy(update=update)


def resolve_joint(dataset: DatasetRef, config: TrainConfig) -> TrainConfig:
    """``config`` with the last two layers' defaults decided where they are unset, by whether labels
    are scarce (fewer than ``SCARCE_LABELS`` of the dataset's nodes in its train split, its
    manifest's count): GAT's pair (``joint_rounds``) trains the last layer's rounds where they are
    and not otherwise; ``joint_fresh`` is on where the pair trains and they are. Fingerprinted as
    the explicit options."""
    scarce = dataset.manifest.splits.get("train", 0) < SCARCE_LABELS * dataset.num_nodes
    if config.model == "gat" and config.joint_rounds is None and scarce:
        paired = config.model_copy(update={"joint_rounds": config.layer_rounds(config.layers)})
        config = paired if paired.trains_jointly else config  # layer-wise, node task, transductive, full batch
    if config.joint_fresh is not None:
        return config
    return config.model_copy(update={"joint_fresh": config.trains_jointly and scarce})


def plan_run(store: Store, dataset: DatasetRef, partition: PartitionRef | None, config: TrainConfig,
             network: NetworkModel) -> RunPlan:
    """Fingerprints of the run and of each layer; centralized runs read the whole dataset."""
    config = resolve_joint(dataset, resolve_warm_start(store, dataset, config))
    whole = config.strategy_spec.whole_graph
    if not whole and partition is None:
        raise RetexoError(f"strategy {config.strategy} needs a partition")
    source_fp = dataset.fp if whole else partition.fp  # type: ignore[union-attr]
    code = code_version(config.strategy)
    run_fp = fingerprint({"code": code, "source": source_fp, "config": config.run_payload()})
    if config.is_layerwise:
        layer_fps = {l: fingerprint({"code": code, "source": source_fp, "layer": l, **config.layer_payload(l)})
                     for l in range(1, config.layers + 1)}
    else:
        layer_fps = {l: fingerprint({"run": run_fp, "layer": l}) for l in range(1, config.layers + 1)}
    deeper = plan_run(store, dataset, partition, config.deeper(), network) if config.chooses_depth else None
    return RunPlan(
        store_root=str(store.root), run_fp=run_fp, dataset_name=dataset.name, dataset_fp=dataset.fp,
        partition_fp=None if whole else partition.fp,  # type: ignore[union-attr]
        partition_method=None if whole else partition.method,  # type: ignore[union-attr]
        source_dir=str(dataset.path if whole else partition.path),  # type: ignore[union-attr]
        whole_graph=whole, world=1 if whole else partition.parts,  # type: ignore[union-attr]
        config=config, network=network, layer_fps=layer_fps, deeper=deeper,
    )


def plan_site_run(store: Store, dataset: DatasetRef, partition: PartitionRef, config: TrainConfig,
                  network: NetworkModel, site: int, sites: int) -> RunPlan:
    """The run of site ``site`` of ``sites``, over its site partition: fingerprinted as
    ``plan_run`` does, plus the site's rank and the number of sites (each site keeps its own run
    folder; they are not shared)."""
    if not config.strategy_spec.at_sites or config.tolerate_failures or config.warm_start:
        raise RetexoError(f"sites train the strategies {', '.join(AT_SITES)} (without warm start or "
                          f"tolerated failures); {config.strategy} needs a central partition")
    if config.choose_depth:
        raise RetexoError("sites train one depth: choose it on a central copy, or train both depths with --layers")
    if config.model == "gat" and config.trains_jointly:
        raise RetexoError("sites do not train GAT's last two layers together: its exchange would pass on rows a "
                          "site received from another; drop --joint-rounds")
    # the defaults at sites: one depth, no fresh pair (a site's split is not the graph's), no GAT pair
    update: dict[str, object] = {"choose_depth": False, "joint_fresh": bool(config.joint_fresh)}
    if config.model == "gat":
        update["joint_rounds"] = 0
    config = config.model_copy(update=update)
    if not 0 <= site < sites:
        raise RetexoError(f"--rank {site} is outside 0..{sites - 1} (--world {sites})")
    plan = plan_run(store, dataset, partition, config, network)
    mark = {"site": site, "sites": sites}
    return replace(plan, run_fp=fingerprint({"run": plan.run_fp, **mark}), world=sites, site=site,
                   layer_fps={l: fingerprint({"layer": fp, **mark}) for l, fp in plan.layer_fps.items()})


def layer_state(plan: RunPlan, layer: int) -> LayerState:
    """``done`` (in this run), ``reusable`` (finished in another run with the same fingerprint) or ``pending``.

    A layer whose manifest is unreadable or whose files changed since the commit is not ``done``
    (``layer_fp_of``: a quick check of each file's size and mtime against the manifest, hashing
    only files whose mtime differs), so it is trained again; the bytes themselves are hashed in
    full when they are read (the next layer's workers) and by ``retexo store verify``. A reuse
    candidate is hashed in full (``find_layer``): linking puts its bytes into a new artefact.
    """
    if layer_fp_of(plan.layer_dir(layer)) == plan.layer_fps[layer]:
        return "done"
    if plan.config.is_layerwise and find_layer(plan.store, layer, plan.layer_fps[layer]) is not None:
        return "reusable"
    return "pending"


def run_label(config: TrainConfig) -> str:
    """A short human name for plots and tables, e.g. ``retexo(avg/5,int8)``, ``retexo(avg/5+dc)``
    (drift correction) or ``bns(0.1)``."""
    if config.strategy == "standard" and config.bns_rate < 1:
        return f"bns({config.bns_rate:g})"
    extras = []
    if config.strategy == "retexo" and config.sync == "avg":
        extras.append(f"avg/{config.sync_every}" + ("+dc" if config.drift_correction else ""))
    if config.compress != "none":
        extras.append(config.compress)
    if config.strategy_spec.layerwise == "optional" and config.layerwise:
        extras.append("layerwise")
    return config.strategy + (f"({','.join(extras)})" if extras else "")
