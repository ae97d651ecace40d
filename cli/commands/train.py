"""The training commands: ``retexo train`` (one run on this machine), ``retexo worker`` (this
machine's share of a run over several) and ``retexo site train`` (one site of several, each with its
own store). Their options come from the models that declare them: ``TrainConfig``,
``PartitionOptions`` (prefixed ``--partition-``, but ``--parts``) and ``NetworkModel``; the run
lifecycle is imported only when a command runs.

The training commands treat SIGTERM like Ctrl-C (``stop_on_sigterm``): a KeyboardInterrupt in
the main thread, so the workers are stopped, the run is recorded ``interrupted`` and the command
exits non-zero. They refuse, before building a partition or spawning anything, to run more worker
processes on this machine than its ceiling (``runner.launch.worker_ceiling``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from cli.console import err, out, print_table, training_bars
from cli.options import OptionGroup, collect, with_options
from cli.shared_options import StoreOption, open_store
from graphstore.partition.methods import PartitionOptions
from graphstore.units import human_bytes
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from retexo_core.recipe import KNOB_NAMES

if TYPE_CHECKING:
    from graphstore.manifests import RunManifest
    from runner.depth import DepthChoice
    from runner.lifecycle import LayerProgress
    from runner.preview import Preview

TRAIN = OptionGroup("train", TrainConfig)
PARTITION = OptionGroup("partition", PartitionOptions, prefix="partition-", unprefixed=frozenset({"parts"}))
NETWORK = OptionGroup("network", NetworkModel)

log = logging.getLogger(__name__)

KIT_ENV = "RETEXO_SITE_KIT"  # a site's kit folder, when --kit is not given
site_app = typer.Typer(help="Train with other sites, each keeping its own store.", no_args_is_help=True)


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (as Ctrl-C does).

    ``retexo run`` keeps it for its whole process: while a Prefect flow runs in the main thread
    Prefect puts its own SIGTERM handler in place (it raises ``TerminationSignal``, which the run
    lifecycle records as ``interrupted`` as well, and stops the workers the same way) and puts
    this one back afterwards."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        log.warning("SIGTERM: stopping")
        raise KeyboardInterrupt("stopped by SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


def check_local_workers(parts: int, strategy: str, nnodes: int = 1, node_rank: int = 0) -> None:
    """The ceiling of worker processes per machine, checked before a partition is built."""
    from runner.launch import check_worker_processes, node_ranks

    from retexo_core.strategies.registry import spec

    world = 1 if spec(strategy).whole_graph else parts
    check_worker_processes(len(node_ranks(world, nnodes, node_rank)))


def show_run(summary: RunManifest, progress: list[LayerProgress], wall: float) -> None:
    """A finished run: its layers, evaluation, kept recipe, bytes on the wire and times."""
    m = summary
    title = (f"run {m.fp}: {m.label} {m.model} on {m.dataset_name} "
             f"({m.parts} parts, {m.method or 'whole graph'}, {m.setting})")
    if progress:
        print_table(title, ["layer", "status", "seconds"],
                    [[p.name, p.state, round(p.seconds, 2)] for p in progress])
    else:
        out.print(title)
    if m.config.get("task") == "link":
        k = m.config.get("hits_k")
        print_table("evaluation (pairs)", ["split", "roc_auc", "mrr", f"hits@{k}", "pairs"],
                    [[r["split"], r["roc_auc"], r["mrr"], r["hits_at_k"], r["pairs"]] for r in m.evaluation])
    else:
        print_table("evaluation", ["split", "accuracy", "macro_f1", "roc_auc", "nodes"],
                    [[r["split"], r["accuracy"], r["macro_f1"], r["roc_auc"], r["nodes"]] for r in m.evaluation])
    recipe = m.recipe.get("layers", {})
    if recipe:
        print_table(f"recipe (reuse it: --recipe <store>/runs/run={m.fp}/recipe.json)", ["layer", *KNOB_NAMES],
                    [[layer, *(str(knobs.get(k, "")) for k in KNOB_NAMES)] for layer, knobs in recipe.items()])
    rows = [[kind, human_bytes(b), b] for kind, b in sorted(m.bytes_by_kind.items())]
    rows.append(["total", human_bytes(m.total_bytes), m.total_bytes])
    print_table("bytes on the wire", ["kind", "size", "bytes"], rows)
    net = m.network
    print_table("time", ["measure", "seconds"], [
        [f"simulated communication ({net['bandwidth_mbps']:g} Mbit/s, {net['latency_ms']:g} ms)", round(m.sim_comm_s, 3)],
        ["training (inside workers, all layers)", round(m.wall_s, 3)],
        ["wall time of this command", round(wall, 3)],
    ])
    if m.platform:
        out.print(f"trained with {m.platform}", markup=False, highlight=False)


def show_depth_choice(choice: DepthChoice) -> None:
    """Both runs of a depth choice (``--choose-depth``): validation and test scores, bytes, the one kept."""
    rows = [[len(m.layers), m.fp, round(m.score("val"), 4), round(m.score("test"), 4), human_bytes(m.total_bytes),
             "kept" if m is choice.kept else ""] for m in (choice.shallower, choice.deeper)]
    print_table(f"depth chosen on validation ({human_bytes(choice.total_bytes)} for both runs, shared layers once)",
                ["layers", "run", f"val {choice.shallower.score_name('val')}", "test", "bytes", ""], rows)


def show_preview(preview: Preview) -> None:
    """The plan and the memory estimates of ``retexo train --dry-run``; exit code 2 when the
    command would be refused."""
    d = preview.dataset
    rows = [["dataset", f"{d.name} ({d.fp}): {d.num_nodes:,} nodes, {d.num_edges:,} edges, "
                        f"{d.num_features:,} features"]]
    if preview.partition is not None:
        p = preview.partition
        rows.append(["partition", f"{p.fp}: {p.method} into {p.parts} parts, {p.halo_total:,} halo rows (stored)"])
    elif preview.partition_to_build is not None:
        o = preview.partition_to_build
        rows.append(["partition", f"to be built: {o.method} into {o.parts} parts (seed {o.seed}); halo not known "
                                  "yet, the estimate takes the largest it can be"])
    else:
        rows.append(["partition", "none: the whole graph in one process"])
    plan = preview.plan
    if plan is not None:
        rows.append(["run", f"{plan.run_fp}: {plan.config.strategy} {plan.config.model}, {plan.world} worker(s)"])
        rows += [[f"layer {layer}", state] for layer, state in preview.layer_states.items()]
        if plan.deeper is not None:
            rows.append(["deeper run", f"{plan.deeper.run_fp}: {plan.deeper.config.layers} layers, trained next "
                                       "(the depth with the higher validation score is kept; --no-choose-depth: one depth)"])
    else:
        rows.append(["run", "its fingerprint follows from the partition's, once built"])
    for estimate in preview.estimates:
        rows.append(["memory", f"{estimate.what}: about {human_bytes(estimate.bytes)}"])
    rows.append(["available", f"{human_bytes(preview.available)} now: "
                              + ("fits" if all(e.bytes <= preview.available for e in preview.estimates)
                                 else "does not fit, the command would be refused")])
    for estimate, gpu in preview.gpu_estimates:
        fits = "fits" if estimate.bytes <= gpu.free else "does not fit, the command would be refused"
        rows.append(["GPU memory", f"{estimate.what}: about {human_bytes(estimate.bytes)}; "
                                   f"{human_bytes(gpu.free)} free now: {fits}"])
    print_table("dry run: nothing is built, trained or written", ["", "plan"], rows)
    if not preview.fits:
        raise typer.Exit(2)


@with_options(TRAIN, PARTITION, NETWORK)
def train_cmd(
    dataset: Annotated[str, typer.Argument(help="Dataset name (newest version) or fingerprint.")],
    store: StoreOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (partition, run, layers to train) "
                                          "and the memory estimates against the memory available, then stop: "
                                          "nothing is built, started or written. Exit code 2 when it would not "
                                          "fit.")] = False,
    **options: Any,
) -> None:
    """Train a GNN over the partitions and print accuracy, bytes by kind, simulated and wall time."""
    from runner.depth import depth_choice
    from runner.lifecycle import run_training
    from runner.request import RunRequest, prepare_run

    stop_on_sigterm()
    started = time.perf_counter()
    st = open_store(store)
    config = collect(TRAIN, options)
    partition_options = collect(PARTITION, options)
    check_local_workers(partition_options.parts, config.strategy)  # type: ignore[attr-defined]
    if dry_run:
        from runner.preview import preview_training

        show_preview(preview_training(st, dataset, partition_options, config, collect(NETWORK, options)))  # type: ignore[arg-type]
        return
    plan = prepare_run(RunRequest(store=str(st.root), dataset=dataset, partition=partition_options, train=config,
                                  network=collect(NETWORK, options)))
    with training_bars() as (on_layer, on_round):
        summary, progress = run_training(plan, on_layer=on_layer, on_round=on_round)
    show_run(summary, progress, time.perf_counter() - started)  # type: ignore[arg-type]
    if plan.deeper is not None:
        show_depth_choice(depth_choice(plan))


def worker_cmd(
    config: Annotated[Path, typer.Argument(help="YAML preset (dataset / partition / train / network); the dataset must be in the store.")],
    nnodes: Annotated[int, typer.Option(help="Number of machines taking part (torchrun --nnodes).")] = 1,
    node_rank: Annotated[int, typer.Option(help="This machine's index, 0..nnodes-1 (node 0 builds the partition and finalises).")] = 0,
    master_addr: Annotated[str, typer.Option(help="Address of the rank-0 machine; 127.0.0.1 binds to loopback only.")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option(help="Free TCP port on the master for the ranks' process group, the same on every node (under torchrun: not its rendezvous port).")] = 29500,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key, e.g. --set train.rounds=50.")] = None,
    audit_dir: Annotated[Optional[Path], typer.Option(help="Write the store files each rank opens to <dir>/rank-<r>.txt (residency audit).")] = None,
    store: StoreOption = None,
) -> None:
    """Run this machine's share of the partition workers of one training run (all pending layers
    in one process group). Every machine sees the same store (e.g. a shared file system). Under
    torchrun (--nproc-per-node 1) the node rank, node count and master come from torchrun, and
    a failed attempt restarted by it (--max-restarts) resumes at the first unfinished layer."""
    from flows.params import load_params
    from runner.launch import node_ranks
    from runner.lifecycle import LaunchOptions, run_training
    from runner.request import prepare_run

    stop_on_sigterm()
    started = time.perf_counter()
    st = open_store(store)
    params = load_params(config, set_)
    launch = LaunchOptions.from_torchrun(os.environ, master_port) or LaunchOptions(
        nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    if audit_dir is not None:
        audit_dir.mkdir(parents=True, exist_ok=True)
        launch = dataclasses.replace(launch, audit_dir=str(audit_dir))
    nnodes, node_rank = launch.nnodes, launch.node_rank
    check_local_workers(params.partition.parts, params.train.strategy, nnodes, node_rank)  # type: ignore[union-attr]
    request = params.run_params(params.dataset.name).request().model_copy(update={"store": str(st.root)})  # type: ignore[union-attr]
    plan = prepare_run(request, node_rank=node_rank, wait_s=params.train.timeout_s)
    ranks = node_ranks(plan.world, nnodes, node_rank)
    err.print(f"node {node_rank}: running ranks {ranks} of run {plan.run_fp}")
    with training_bars() as (on_layer, on_round):
        summary, progress = run_training(plan, launch, on_layer, on_round)
    if summary is None:
        err.print(f"node {node_rank}: ranks {ranks} finished")
        return
    show_run(summary, progress, time.perf_counter() - started)
    if plan.deeper is not None:
        from runner.depth import depth_choice

        show_depth_choice(depth_choice(plan))


@site_app.command("train")
@with_options(TRAIN, NETWORK)
def site_train_cmd(
    dataset: Annotated[str, typer.Argument(help="This site's dataset (ingested with --remote-sources), name or fingerprint.")],
    rank: Annotated[int, typer.Option(help="This site's rank, 0..world-1, fixed for the run (site 0 coordinates).")],
    world: Annotated[int, typer.Option(help="Number of sites training together.")],
    master_addr: Annotated[str, typer.Option(help="Address of site 0, where the sites' process group forms.")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option(help="Free TCP port on site 0 for the process group (the same at every site).")] = 29500,
    audit_dir: Annotated[Optional[Path], typer.Option(help="Write the store files this site's rank opens to <dir>/rank-<r>.txt (residency audit).")] = None,
    kit: Annotated[Optional[Path], typer.Option(envvar=KIT_ENV, help="This site's kit from `retexo site provision`: every byte between sites then crosses mutually authenticated TLS 1.3 links.")] = None,
    store: StoreOption = None,
    **options: Any,
) -> None:
    """Train together with other sites, each holding its own store: this site's nodes and the edges
    into them (remote sources by id). Every site runs this command with the same training
    options; only the strategy's counted rows, node ids (discovery) and the coordinator's model,
    metrics and byte totals leave a site. With --kit the sites admit only each other and encrypt
    every link (see docs/sites.md, Security)."""
    from retexo_core.comm.tls import Kit
    from runner.lifecycle import LaunchOptions, run_training
    from runner.request import RunRequest, SiteSeat, prepare_run

    stop_on_sigterm()
    started = time.perf_counter()
    if kit is not None:
        own = Kit.open(kit).identity()
        if own.rank != rank:
            raise typer.BadParameter(f"the kit at {kit} is {own}'s, not site {rank}'s", param_hint="--kit")
    else:
        err.print(f"site {rank}: no --kit (nor ${KIT_ENV}): the links to the other sites are plaintext and "
                  "admit anyone who reaches the port; see `retexo site provision`")
    st = open_store(store)
    config = collect(TRAIN, options)
    if config.secure_agg and (kit is None or world < 3):
        raise typer.BadParameter("needs --kit (its pairwise seeds travel over the TLS links) and 3 sites or more "
                                 "(with two, the sum and a site's own gradient give away the other's)",
                                 param_hint="--secure-agg")
    plan = prepare_run(RunRequest(store=str(st.root), dataset=dataset, train=config, network=collect(NETWORK, options),
                                  site=SiteSeat(rank=rank, world=world)))
    launch = LaunchOptions(nnodes=world, node_rank=rank, master_addr=master_addr, master_port=master_port,
                           audit_dir=str(audit_dir) if audit_dir is not None else None, attempts=1,
                           kit=str(kit.resolve()) if kit is not None else None)
    if audit_dir is not None:
        audit_dir.mkdir(parents=True, exist_ok=True)
    err.print(f"site {rank} of {world}: run {plan.run_fp} in {st.root}")
    with training_bars() as (on_layer, on_round):
        summary, progress = run_training(plan, launch, on_layer, on_round if rank == 0 else None)
    show_run(summary, progress, time.perf_counter() - started)  # type: ignore[arg-type]
    if summary is not None and summary.bytes_by_site:  # type: ignore[union-attr]
        print_table("bytes sent per site", ["site", "bytes"], sorted(summary.bytes_by_site.items()))  # type: ignore[union-attr]
