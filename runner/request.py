"""The one front door of a run: what a user asks for (``RunRequest``) and ``prepare_run``, which turns
it into the ``RunPlan`` that the lifecycle trains. The command line, the flows, the tasks (the
promotion gate's evaluation runs included) and the benchmarks all come through here, so that the
dataset and partition lookups, the warm-start checks, "a whole-graph strategy needs no partition",
sites and baseline runs are decided in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from graphstore.errors import InputError, RetexoError, StoreError
from graphstore.layout import Store
from graphstore.lookup import DatasetRef, PartitionRef, find_dataset, find_partition
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.partition.site import build_site_partition
from retexo_core.comm.network import NetworkModel
from retexo_core.config import Strategy, TrainConfig
from runner.plan import RunPlan, plan_run, plan_site_run, resolve_warm_start

log = logging.getLogger("retexo.runner")
T = TypeVar("T")
# where the partition comes from: built when missing (node 0; other nodes wait for it to appear
# in their shared store), or already stored (a flow's partition stage built it)
PartitionSource = Literal["build", "stored"]


class SiteSeat(BaseModel):
    """A site's place in a run of sites, each over its own store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(description="This site's rank, 0..world-1 (0 coordinates)")
    world: int = Field(description="Number of sites")


class RunSettings(BaseModel):
    """Where and how to run, whatever the dataset: the store, the partitioning, the training and
    the simulated network (shared with the flows' parameters, ``flows.params``)."""

    model_config = ConfigDict(extra="forbid")

    store: str | None = Field(None, description="Store root (default: $RETEXO_STORE or ./retexo-store)")
    partition: PartitionOptions = Field(default_factory=PartitionOptions)
    train: TrainConfig = Field(default_factory=TrainConfig)
    network: NetworkModel = Field(default_factory=NetworkModel)


class RunRequest(RunSettings):
    """One training run as a user asks for it."""

    dataset: str = Field(description="Dataset name (newest version) or fingerprint")
    site: SiteSeat | None = Field(None, description="A site's run over the site partition of its own store")
    cold_start_if_unfit: bool = Field(False, description="When the warm-start run does not fit this one, "
                                      "start cold with a warning instead of failing (a pipeline's promoted model)")

    @classmethod
    def over(cls, store: Store, dataset: DatasetRef, partition: PartitionRef | None, train: TrainConfig,
             network: NetworkModel | None = None) -> "RunRequest":
        """The request of a run over stored references (the benchmarks), to prepare with
        ``partitions="stored"``; a whole-graph strategy ignores ``partition``."""
        options = PartitionOptions() if partition is None else PartitionOptions(**partition.manifest.options_payload())
        return cls(store=str(store.root), dataset=dataset.fp, partition=options, train=train,
                   network=network or NetworkModel())

    def baseline(self, strategy: Strategy, layers: int | None = None) -> "RunRequest":
        """This run trained with ``strategy`` instead: the same dataset, partition, network and
        shared options (model, layers, hidden, learning rate, dropout, seed, ...), no warm start;
        ``layers``: at this depth, without a depth choice (the depth the run chose)."""
        train = TrainConfig.model_validate({**self.train.model_dump(), "strategy": strategy, "warm_start": None})
        if layers is not None:
            train = train.at_depth(layers)
        return self.model_copy(update={"train": train, "cold_start_if_unfit": False})


def prepare_run(request: RunRequest, partitions: PartitionSource = "build", node_rank: int = 0,
                wait_s: float = 0.0, warn: Callable[[str], None] = log.warning) -> RunPlan:
    """The plan of ``request``: its dataset, its partition (none for a whole-graph strategy; the
    site partition for a site), its warm start checked, its fingerprints.

    ``partitions="build"``: node ``node_rank`` 0 builds a missing partition, the other nodes of a
    multi-node launch wait up to ``wait_s`` for it to appear in the shared store; ``"stored"``: a
    missing partition is a ``StoreError`` saying to run the partition flow first. ``warn``: where
    a dropped warm start is reported (a flow's run logger).
    """
    store = Store.open(request.store)
    config = request.train
    if config.secure_agg and request.site is None:
        raise RetexoError("--secure-agg masks the sums between sites: use it with `retexo site train`")
    waits = partitions == "build" and node_rank != 0
    dataset = (awaited(lambda: find_dataset(store, request.dataset), f"dataset {request.dataset}", store, wait_s)
               if waits else find_dataset(store, request.dataset))
    check_task(dataset, config)
    config = checked_warm_start(store, dataset, config, request.cold_start_if_unfit, warn)
    if request.site is not None:
        partition = build_site_partition(store, dataset)
        return plan_site_run(store, dataset, partition, config, request.network, request.site.rank, request.site.world)
    partition = None
    if not config.strategy_spec.whole_graph:
        if partitions == "stored":
            partition = stored_partition(store, dataset, request.partition)
        elif waits:
            partition = awaited(lambda: find_partition(store, dataset, request.partition),
                                f"partition of {dataset.name}", store, wait_s)
        else:
            partition = build_partition(store, dataset, request.partition, force=config.force)
    return plan_run(store, dataset, partition, config, request.network)


def check_task(dataset: DatasetRef, config: TrainConfig) -> None:
    """``--task link`` trains on a link dataset (held-out edges and pairs), and a link dataset
    trains nothing else: its graph lacks the held-out edges."""
    task = dataset.manifest.task
    if config.task == task:
        return
    if config.task == "link":
        raise InputError("--task", f"dataset {dataset.name} has no held-out edges: derive a link dataset with "
                                   f"`retexo ingest link-split {dataset.name} --name {dataset.name}_link` and train on it")
    raise InputError("--task", f"dataset {dataset.name} is a link split (its graph lacks the held-out edges): train "
                               "it with --task link, or train node classification on its source dataset")


def checked_warm_start(store: Store, dataset: DatasetRef, config: TrainConfig, cold_if_unfit: bool,
                       warn: Callable[[str], None]) -> TrainConfig:
    """``config`` with its warm start resolved (``resolve_warm_start``); with ``cold_if_unfit``, a
    warm start that does not fit is dropped with a warning."""
    try:
        return resolve_warm_start(store, dataset, config)
    except StoreError as exc:
        if not cold_if_unfit:
            raise
        warn(f"cold start: the warm-start model does not fit this run ({exc})")
        return config.model_copy(update={"warm_start": None})


def stored_partition(store: Store, dataset: DatasetRef, options: PartitionOptions) -> PartitionRef:
    found = find_partition(store, dataset, options)
    if found is None:
        raise StoreError(f"dataset {dataset.name} has no {options.method} partition into {options.parts} parts yet: "
                         "run the partition flow first")
    return found


def awaited(find: Callable[[], T | None], what: str, store: Store, wait_s: float) -> T:
    """What ``find`` finds, asked every 0.5 s for up to ``wait_s`` (another node of a multi-node
    launch builds it into the shared store)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = find()
        except RetexoError:
            found = None
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise RetexoError(f"{what} did not appear in {store.root} within {wait_s:.0f} s")
        time.sleep(0.5)
