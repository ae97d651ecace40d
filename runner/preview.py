"""What ``retexo train`` would do, without doing it (``--dry-run``): the dataset, the partition
(stored, or to be built), the run and the state of each of its layers, the worker processes, and
the memory estimates the command checks before it starts, against the memory available now.

Nothing is built, trained or written: a missing partition is described, not made, and the
training estimate then takes the largest halo the partition could have (every other part's
nodes, at most one per edge), so it can only be higher than the real one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphstore.layout import Store
from graphstore.limits import (Estimate, TrainingSizes, available_memory, gpu_estimate, partition_estimate,
                               training_estimate)
from graphstore.lookup import DatasetRef, PartitionRef, find_dataset, find_partition
from graphstore.parquet_io import decoded_feature_bytes
from graphstore.partition.methods import PartitionOptions
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.gpus import Gpu, ranks_per_gpu, training_gpus
from runner.plan import RunPlan, layer_state
from runner.request import RunRequest, prepare_run


@dataclass
class Preview:
    """The plan of one ``retexo train`` and the memory it needs (bytes)."""

    dataset: DatasetRef
    partition: PartitionRef | None  # None: centralized, or not built yet (``partition_to_build``)
    partition_to_build: PartitionOptions | None
    plan: RunPlan | None  # None while the partition it trains on is not built
    layer_states: dict[int, str] = field(default_factory=dict)
    estimates: list[Estimate] = field(default_factory=list)  # in the order the command checks them
    available: int = 0
    gpu_estimates: list[tuple[Estimate, Gpu]] = field(default_factory=list)  # each GPU the ranks will use

    @property
    def fits(self) -> bool:
        return (all(e.bytes <= self.available for e in self.estimates)
                and all(e.bytes <= gpu.free for e, gpu in self.gpu_estimates))


def worst_case_halo(dataset: DatasetRef, parts: int) -> int:
    """The most halo rows ``parts`` parts of ``dataset`` can need in all: each part at most every
    node it does not own, and never more than one per edge."""
    return min(dataset.num_edges, dataset.num_nodes * max(parts - 1, 0))


def training_sizes(dataset: DatasetRef, config: TrainConfig, world: int, halo_total: int) -> TrainingSizes:
    """What the memory of ``world`` workers over a partition whose halo has ``halo_total`` rows (0
    for the whole graph) depends on, from the dataset's manifest and its features file's footer
    (nothing is loaded)."""
    manifest = dataset.manifest
    features = decoded_feature_bytes(dataset.path / "features.parquet", manifest.feature_format,
                                     manifest.num_nodes, manifest.num_features)
    return TrainingSizes(
        nodes=manifest.num_nodes, edges=manifest.num_edges, features=manifest.num_features, feature_bytes=features,
        sparse=manifest.feature_format == "sparse", hidden=config.hidden, layers=config.layers,
        workers=max(world, 1), halo_nodes=halo_total, heads=config.heads if config.model == "gat" else 1,
        layerwise=config.is_layerwise, joint=config.trains_jointly,
        two_hop=config.trains_jointly and config.model == "gat")


def memory_for(dataset: DatasetRef, config: TrainConfig, world: int, halo_total: int, local_ranks: int,
               on_gpu: bool = False) -> Estimate:
    """The host memory estimate of ``local_ranks`` of ``world`` workers (see ``training_sizes``;
    ``on_gpu``: they compute on GPUs)."""
    sizes = training_sizes(dataset, config, world, halo_total)
    return training_estimate(sizes, on_gpu).scaled(local_ranks / max(world, 1))


def gpu_memory_for(dataset: DatasetRef, config: TrainConfig, world: int, halo_total: int, ranks: list[int],
                   gpus: list[Gpu]) -> list[tuple[Estimate, Gpu]]:
    """The GPU memory estimate of each of ``gpus`` that this machine's ``ranks`` compute on."""
    if not gpus:
        return []
    sizes = training_sizes(dataset, config, world, halo_total)
    return [(gpu_estimate(sizes, f"GPU {i} ({gpus[i].name})", count), gpus[i])
            for i, count in sorted(ranks_per_gpu(ranks, len(gpus)).items())]


def preview_training(store: Store, dataset: str, options: PartitionOptions, config: TrainConfig,
                     network: NetworkModel) -> Preview:
    """What ``retexo train DATASET`` with these options would do on this machine (one node)."""
    gpus = training_gpus(config.device)  # --device cuda without a GPU: the command's own refusal
    ref = find_dataset(store, dataset)
    preview = Preview(ref, None, None, None, available=available_memory())
    whole = config.strategy_spec.whole_graph
    if not whole:
        preview.partition = find_partition(store, ref, options)
        if preview.partition is None:
            preview.partition_to_build = options
            preview.estimates.append(partition_estimate(ref.num_nodes, ref.num_edges, options.parts))
    if whole or preview.partition is not None:
        preview.plan = prepare_run(RunRequest(store=str(store.root), dataset=ref.fp, partition=options, train=config,
                                              network=network), partitions="stored")
    if preview.plan is not None:
        preview.layer_states = {layer: layer_state(preview.plan, layer) for layer in preview.plan.layers}
    world = 1 if whole else options.parts
    halo = (0 if whole else
            preview.partition.halo_total if preview.partition is not None else worst_case_halo(ref, options.parts))
    if any(state != "done" for state in preview.layer_states.values()) or preview.plan is None:
        preview.estimates.append(memory_for(ref, config, world, halo, world, on_gpu=bool(gpus)))
        preview.gpu_estimates = gpu_memory_for(ref, config, world, halo, list(range(world)), gpus)
    return preview
