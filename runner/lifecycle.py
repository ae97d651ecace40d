"""The run lifecycle: bring every layer of a run into the store, then finalise it.

A finished layer is never retrained: it is skipped in the same run (``cached``), or hard-linked
from another run with the same layer fingerprint (``reused``). The layers from the first one that
is missing to the last are trained in ONE launch of the process group (``trained``), each committed
as it finishes, so a run killed during layer 2 resumes at layer 2. End-to-end strategies produce
all layers in one launch. Run events (started, completed, failed, interrupted) go to the run's
history.

Concurrent runs of one store: node 0's launcher takes the writer locks of the layers it is about
to train and then looks at them again; a layer that another run committed meanwhile is reported
``cached`` and not trained again (nothing is launched when all are). While node 0 trains a run it
holds the run (``graphstore.history.hold_run``); a run left ``started`` by a launcher that is gone
is first marked ``interrupted`` ("abandoned"). Interrupts (Ctrl-C, SIGTERM through the CLI, a
Prefect termination) are recorded as ``interrupted``, errors as ``failed``; the run of a launcher
killed outright (SIGKILL) is recorded ``interrupted`` by the launcher's guard process
(``runner.descendant_guard``) once its workers are gone.

Every entry point calls this module: ``retexo train``, ``retexo worker`` (one node of several),
the Prefect train task and the benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from graphstore.atomic import writer_lock
from graphstore.catalog import refresh_catalog
from graphstore.errors import RetexoError, StoreError
from graphstore.history import hold_run, mark_abandoned, record_run_event
from graphstore.integrity import intact_manifest
from graphstore.limits import Estimate, check_memory
from graphstore.layout import MANIFEST, TMP_PREFIX, is_complete
from graphstore.lookup import PartitionRef, find_dataset, find_layer, layer_fp_of
from graphstore.manifests import RunManifest, read_manifest
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.runs import link_layer
from runner.depth import depth_choice
from runner.descendant_guard import guard_run
from runner.finalize import finalize_run
from runner.launch import (Launcher, WorkerFailed, check_worker_processes, default_threads, free_port, node_ranks,
                           run_workers)
from runner.plan import RunPlan, layer_state
from runner.gpus import Gpu, training_gpus
from runner.preview import gpu_memory_for, memory_for
from runner.results import RoundProgress, StageSpec, clear_progress, read_progress
from runner.worker import WorkerJob

log = logging.getLogger(__name__)
T = TypeVar("T")  # a progress item


@dataclass(frozen=True)
class LaunchOptions:
    """Where this process's ranks run: one node of ``nnodes`` (torchrun's contract), as processes,
    or as threads of this process (one node only; for tests and tiny runs)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, retried once if it was taken meanwhile
    launcher: Launcher = "processes"
    audit_dir: str | None = None  # record the files each rank opens (residency audit)
    attempts: int = 2
    kit: str | None = None  # a site's kit folder: the sites link by mutual TLS (``retexo_core.comm.mesh``)

    @classmethod
    def from_torchrun(cls, env: Mapping[str, str], master_port: int) -> "LaunchOptions | None":
        """This node's launch when torchrun started this process (``TORCHELASTIC_RUN_ID`` is set),
        else None. torchrun runs one ``retexo worker`` per node (``--nproc-per-node 1``), which
        starts the node's ranks itself: node rank ``GROUP_RANK`` of ``GROUP_WORLD_SIZE``; the ranks'
        process group forms at ``MASTER_ADDR:master_port``, hosted by rank 0 and so new in every
        attempt (torchrun's own store outlives attempts, and its restart count is counted per
        node, so keys there could be read from an earlier attempt)."""
        if "TORCHELASTIC_RUN_ID" not in env:
            return None
        if env.get("LOCAL_WORLD_SIZE", "1") != "1":
            raise RetexoError(f"torchrun started {env['LOCAL_WORLD_SIZE']} processes on this node: run it with "
                              "--nproc-per-node 1 (each node's `retexo worker` starts that node's ranks itself)")
        return cls(nnodes=int(env["GROUP_WORLD_SIZE"]), node_rank=int(env["GROUP_RANK"]),
                   master_addr=env["MASTER_ADDR"], master_port=master_port, attempts=1)


@dataclass
class LayerProgress:
    layer: int
    state: str  # trained | reused | cached
    seconds: float
    depth: int | None = None  # a depth choice (``runner.depth``): the layers of the run it belongs to

    @property
    def name(self) -> int | str:
        """The layer's number, or ``l/depth`` in a depth choice (layer l of the run of that depth)."""
        return f"{self.layer}/{self.depth}" if self.depth else self.layer


def keeps_store(plan: RunPlan, launch: LaunchOptions) -> bool:
    """This node keeps the run in its store: locks, temp folders, events, finalisation (node 0
    of a shared store; every site of a run of sites, each one rank, its node rank)."""
    return launch.node_rank == 0 or plan.site is not None


OnLayer = Callable[[LayerProgress], None]
OnRound = Callable[[RoundProgress], None]


def invalidate_run(plan: RunPlan) -> None:
    """A layer of the run is about to change: its run-level summary no longer holds."""
    manifest = plan.store.run_dir(plan.run_fp) / MANIFEST
    with writer_lock(plan.store, manifest.parent):
        manifest.unlink(missing_ok=True)


def reuse_layer(plan: RunPlan, layer: int) -> None:
    """Hard-link the finished layer with the same fingerprint from another run into this one."""
    invalidate_run(plan)
    source = find_layer(plan.store, layer, plan.layer_fps[layer])
    if source is None:
        raise StoreError(f"no finished layer {layer} with fingerprint {plan.layer_fps[layer]} to reuse")
    target = plan.layer_dir(layer)
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)
    link_layer(plan.store, source, target, plan.run_fp)


def refresh_partitions(plan: RunPlan) -> tuple[str, ...]:
    """grappa: the partitions of refresh periods 1, 2, ... (same method, next seeds), built into the
    store before the launch so that workers load them like any partition."""
    cfg = plan.config
    if not cfg.strategy_spec.refreshes_partitions:
        return ()
    source = PartitionRef.at(Path(plan.source_dir))
    options = PartitionOptions(**source.manifest.options_payload())
    dataset = find_dataset(plan.store, plan.dataset_fp)
    periods = -(-cfg.epochs // cfg.grappa_refresh_every)
    return tuple(str(build_partition(plan.store, dataset, options.model_copy(update={"seed": options.seed + k})).path)
                 for k in range(1, periods))


def launch_layers(plan: RunPlan, layers: list[int], launch: LaunchOptions, on_layer: OnLayer | None = None,
                  on_round: OnRound | None = None) -> None:
    """One launch of the process group that trains ``layers`` (consecutive) of the run.

    Node 0 holds the writer locks of the layer folders; every node runs its block of ranks.
    Once it holds the locks, a single-node launch looks at the layers again: the leading layers
    that another run committed while this one waited are reported ``cached`` and not trained (if
    that is all of them, nothing is launched). ``on_layer`` hears of each layer as soon as it is
    committed, ``on_round`` of rank 0's rounds (read from the ranks' progress files). A port clash
    ("address already in use") is retried on a fresh port when the port was chosen here.
    """
    store, host = plan.store, keeps_store(plan, launch)
    ranks = node_ranks(plan.world, launch.nnodes, launch.node_rank)
    refresh = refresh_partitions(plan) if host or plan.config.strategy == "grappa" else ()
    reported: set[int] = set()
    last = [time.perf_counter()]
    shown: dict[int, RoundProgress] = {}  # the progress last reported, per layer (0: end-to-end)
    watched = (layers if plan.config.is_layerwise else [0]) if on_round is not None else []
    if host:
        clear_progress(plan.store_root, plan.run_fp)

    def watch() -> None:
        for layer in watched:
            now = read_progress(plan.store_root, plan.run_fp, layer, plan.world)
            if now is not None and now != shown.get(layer):
                shown[layer] = now
                on_round(now)  # type: ignore[misc]
        for layer in layers:
            if layer not in reported and layer_fp_of(plan.layer_dir(layer)) == plan.layer_fps[layer]:
                reported.add(layer)
                now = time.perf_counter()
                if on_layer is not None:
                    on_layer(LayerProgress(layer, "trained", now - last[0]))
                last[0] = now

    for attempt in range(launch.attempts):
        address = launch.master_addr if launch.master_addr != "localhost" else "127.0.0.1"
        port = launch.master_port or free_port(address)
        stages = tuple(StageSpec(layer=l, fp=plan.layer_fps[l], target=str(plan.layer_dir(l)),
                                 temp=str(plan.layer_dir(l).parent / f"{TMP_PREFIX}layer={l}-{port}"))
                       for l in layers if l not in reported)
        with ExitStack() as locks, tempfile.TemporaryDirectory(prefix="retexo-errors-") as error_dir:
            if host:
                for stage in stages:
                    locks.enter_context(writer_lock(store, Path(stage.target)))
                if launch.nnodes == 1:
                    stages = skip_committed(plan, stages, reported, on_layer)
                    if not stages:
                        return
                invalidate_run(plan)
                for stage in stages:
                    target = Path(stage.target)
                    if target.exists() and layer_fp_of(target) != stage.fp:
                        shutil.rmtree(target)  # a stale layer of an older code version, or incomplete
                    Path(stage.temp).mkdir(parents=True, exist_ok=True)
            job = WorkerJob(
                store_root=str(store.root), run_fp=plan.run_fp, source_dir=plan.source_dir,
                whole_graph=plan.whole_graph, config=plan.config, network=plan.network, stages=stages,
                world=plan.world, error_dir=error_dir, master_addr=launch.master_addr, master_port=port,
                threads=default_threads(len(ranks)), audit_dir=launch.audit_dir, refresh_dirs=refresh,
                launcher_hosts_rendezvous=plan.config.tolerate_failures, site=plan.site is not None, holds_run=host,
                kit=launch.kit,
            )
            try:
                dropped = run_workers(job, ranks, host=launch.node_rank == 0, launcher=launch.launcher, watch=watch)
                if dropped:
                    log.warning("ranks %s failed and were dropped; the run went on without them", dropped)
                return
            except WorkerFailed as exc:
                clash = "address already in use" in str(exc).lower() and launch.master_port is None
                if not clash or attempt == launch.attempts - 1:
                    raise
                log.warning("port %d was taken, retrying on a fresh port", port)
            finally:
                if host:
                    for stage in stages:
                        shutil.rmtree(stage.temp, ignore_errors=True)


def skip_committed(plan: RunPlan, stages: tuple[StageSpec, ...], reported: set[int],
                   on_layer: OnLayer | None) -> tuple[StageSpec, ...]:
    """The stages still to train, once this launcher holds their locks: leading layers that another
    run committed meanwhile are reported ``cached`` (all layers of an end-to-end run, or none)."""
    done = [layer_fp_of(Path(s.target)) == s.fp for s in stages]
    skip = len(stages) if all(done) else 0
    if plan.config.is_layerwise:
        skip = next((i for i, d in enumerate(done) if not d), len(stages))
    for stage in stages[:skip]:
        log.info("layer %d was committed by another run meanwhile: not training it again", stage.layer)
        reported.add(stage.layer)
        if on_layer is not None:
            on_layer(LayerProgress(stage.layer, "cached", 0.0))
    return stages[skip:]


def ensure_layers(plan: RunPlan, launch: LaunchOptions = LaunchOptions(),
                  on_layer: OnLayer | None = None, on_round: OnRound | None = None) -> list[LayerProgress]:
    """Bring every layer of the run into the store: cached layers are skipped, reusable ones
    linked (node 0), and the rest trained in one launch. Sites always launch: their workers agree
    on the first layer some site lacks (``runner.worker.meet_sites``)."""
    states = {l: layer_state(plan, l) for l in plan.layers}
    pending = [l for l in plan.layers if states[l] == "pending"]
    if (not plan.config.is_layerwise and pending) or plan.site is not None:
        pending = plan.layers
    first = pending[0] if pending else plan.layers[-1] + 1
    progress: list[LayerProgress] = []

    def report(item: LayerProgress) -> None:
        progress.append(item)
        if on_layer is not None:
            on_layer(item)

    for layer in plan.layers:
        if layer >= first:
            break
        started = time.perf_counter()
        if states[layer] == "reusable" and launch.node_rank == 0:
            reuse_layer(plan, layer)
        report(LayerProgress(layer, "reused" if states[layer] == "reusable" else "cached",
                             time.perf_counter() - started))
    if pending:
        launch_layers(plan, plan.layers[first - 1:], launch, report, on_round)
    return progress


def run_training(plan: RunPlan, launch: LaunchOptions = LaunchOptions(), on_layer: OnLayer | None = None,
                 on_round: OnRound | None = None) -> tuple[RunManifest | None, list[LayerProgress]]:
    """Train (or reuse) every layer, then finalise the run (``train_run``; node 0 returns its
    manifest, other nodes None). With a depth choice (``plan.deeper``), the run one layer deeper
    next, and the manifest of the one kept on validation (``runner.depth``); the progress items
    and the callbacks' items then carry their run's depth."""
    if plan.deeper is None:
        return train_run(plan, launch, on_layer, on_round)
    progress = []
    for one in (plan, plan.deeper):
        depth = one.config.layers
        summary, more = train_run(one, launch, with_depth(on_layer, depth), with_depth(on_round, depth))
        progress += [dataclasses.replace(p, depth=depth) for p in more]
    if summary is None:
        return None, progress
    choice = depth_choice(plan)
    log.info("%s", choice.describe())
    return choice.kept, progress


def with_depth(callback: Callable[[T], None] | None, depth: int) -> Callable[[T], None] | None:
    """``callback`` hearing each item (a ``LayerProgress`` or ``RoundProgress``) with its run's ``depth`` set."""
    if callback is None:
        return None
    return lambda item: callback(dataclasses.replace(item, depth=depth))


def train_run(plan: RunPlan, launch: LaunchOptions = LaunchOptions(), on_layer: OnLayer | None = None,
              on_round: OnRound | None = None) -> tuple[RunManifest | None, list[LayerProgress]]:
    """Train (or reuse) every layer of one run, then finalise it (node 0; other nodes return None).

    Node 0 holds the run while it trains it and records its events: ``started``; then
    ``completed``, ``failed`` (an error) or ``interrupted`` (KeyboardInterrupt, SIGTERM through
    the CLI, a Prefect termination: any BaseException that is not an Exception). A run whose last
    event is ``started`` but which no process holds is marked ``interrupted`` first. If this
    process is killed (SIGKILL included), its guard (``runner.descendant_guard.guard_run``) records
    ``interrupted`` and removes the run's temp folders once the workers are gone.
    """
    gpus = training_gpus(plan.config.device)  # --device cuda without a GPU: one line, before anything
    host = keeps_store(plan, launch)
    run_dir = plan.store.run_dir(plan.run_fp)
    if host and plan.site is None and intact_manifest(run_dir, RunManifest) is not None and all(layer_state(plan, l) == "done"
                                                                         for l in plan.layers):
        return read_manifest(run_dir, RunManifest), [LayerProgress(l, "cached", 0.0) for l in plan.layers]
    ranks = node_ranks(plan.world, launch.nnodes, launch.node_rank)
    local_ranks = len(ranks)
    if launch.launcher == "processes":
        check_worker_processes(local_ranks)
    check_memory(training_memory(plan, local_ranks, on_gpu=bool(gpus)), plan.config.force)
    for estimate, gpu in training_gpu_memory(plan, ranks, gpus):
        check_memory(estimate, plan.config.force, available=gpu.free, where=f"on GPU {gpu.index} now")
    if not host:
        return None, ensure_layers(plan, launch, on_layer, on_round)
    mark_abandoned(plan.store, plan.run_fp)  # left "started" by a launcher that is gone
    with guard_run(plan.store, plan.run_fp), hold_run(plan.store, plan.run_fp):
        record_run_event(plan.store, plan.run_fp, "started", plan.config.strategy)
        try:
            progress = ensure_layers(plan, launch, on_layer, on_round)
            if all(p.state == "cached" for p in progress) and intact_manifest(run_dir, RunManifest) is not None:
                summary = read_manifest(run_dir, RunManifest)  # another run finished it meanwhile
            else:
                summary = finalize_run(plan)
        except BaseException as exc:
            event = "failed" if isinstance(exc, Exception) else "interrupted"
            record_run_event(plan.store, plan.run_fp, event, str(exc)[:500] or type(exc).__name__)
            raise
        record_run_event(plan.store, plan.run_fp, "completed", f"test_acc={summary.test_acc}")
    refresh_catalog(plan.store)
    return summary, progress


def training_memory(plan: RunPlan, local_ranks: int, on_gpu: bool = False) -> Estimate:
    """The memory estimate of this node's ``local_ranks`` workers (``on_gpu``: computing on GPUs),
    from the dataset's manifest, its features file's footer and the partition's halo size (nothing
    is loaded)."""
    return memory_for(find_dataset(plan.store, plan.dataset_fp), plan.config, plan.world, halo_total(plan), local_ranks,
                      on_gpu)


def training_gpu_memory(plan: RunPlan, ranks: list[int], gpus: list[Gpu]) -> list[tuple[Estimate, Gpu]]:
    """The GPU memory estimate of each GPU that this node's ``ranks`` compute on (none on the CPU)."""
    if not gpus:
        return []
    dataset = find_dataset(plan.store, plan.dataset_fp)
    return gpu_memory_for(dataset, plan.config, plan.world, halo_total(plan), ranks, gpus)


def halo_total(plan: RunPlan) -> int:
    """Halo rows of the run's partition in all (0 for the whole graph)."""
    return 0 if plan.whole_graph else PartitionRef.at(Path(plan.source_dir)).halo_total
