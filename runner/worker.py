"""What one rank runs: as a spawned process (``process_main``) or as a thread of the launcher
(``thread_main``, for tests and tiny runs). Both end in ``run_rank``: build the communicator, read
this rank's partition, and let ``retexo_core.stages`` train the launch's layers.

A worker reads only ``part=<rank>`` of the partition (plus the partition manifest) and its own rows
of earlier layers; everything else arrives through the communicator and is counted.

A spawned worker never outlives its launcher (``runner.launcher_watch``, started first thing in
``train_in_process``): it ends at once, committing nothing, when the launcher dies. The workers
of the launcher that keeps the run's store hold the run (``graphstore.history.hold_run``) for
their whole life, so the launcher's guard (``runner.descendant_guard``), which records the run
``interrupted`` and removes the launch's temp folders when the launcher is killed, does so once
every worker is gone.

For the launcher's hang watch (``runner.launch``) every worker leaves files in the launch's
``error_dir``: ``rank-<r>.started`` (its pid), ``.joining`` (it reached the rendezvous),
``.joined`` (the process group formed) and ``.alive``, touched every ``HEARTBEAT_S`` seconds by a
daemon thread. A rendezvous that times out raises ``RendezvousTimeout``, so the launcher can tell
the ranks that waited from the rank that never came.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from typing import TYPE_CHECKING, Literal, NoReturn

from graphstore.history import hold_run
from graphstore.layout import Store
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.launcher_watch import watch_launcher
from runner.results import StageSpec

if TYPE_CHECKING:  # the training core (torch) is imported by the ranks only, not by the launcher
    from retexo_core.comm.communicator import Communicator
    from retexo_core.comm.transport import Transport
    from retexo_core.data import PartData


@dataclass(frozen=True)
class WorkerJob:
    """Everything a rank needs (picklable; the same for every rank of a launch)."""

    store_root: str
    run_fp: str
    source_dir: str  # partition folder, or dataset folder when whole_graph
    whole_graph: bool
    config: TrainConfig
    network: NetworkModel
    stages: tuple[StageSpec, ...]
    world: int
    error_dir: str
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    threads: int = 1
    audit_dir: str | None = None
    launcher_hosts_rendezvous: bool = False  # else rank 0 hosts it (the launcher then needs no torch)
    holds_run: bool = False  # the launcher keeps the run's store: each worker process holds the run too
    refresh_dirs: tuple[str, ...] = field(default_factory=tuple)  # grappa: partitions of refresh periods 1, 2, ...
    site: bool = False  # one site of several, each with its own store: source_dir is its site partition
    kit: str | None = None  # a site's kit: sites link by mutual TLS (no rendezvous store, no gloo)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.config.timeout_s)


HEARTBEAT_S = 1.0  # seconds between two touches of a worker's ``.alive`` file
Marker = Literal["started", "joining", "joined", "alive"]


class RendezvousTimeout(RuntimeError):
    """The process group did not form in time: some rank never reached the rendezvous."""


class RankTaken(RuntimeError):
    """Another process joined this launch's rendezvous with the same rank first."""


def error_file(job: WorkerJob, rank: int) -> Path:
    return Path(job.error_dir) / f"rank-{rank}.txt"


def marker(job: WorkerJob, rank: int, kind: Marker) -> Path:
    """The file a worker leaves in ``error_dir`` when it has started, reached the rendezvous,
    joined the process group; ``alive`` is its heartbeat (see the module docstring)."""
    return Path(job.error_dir) / f"rank-{rank}.{kind}"


def start_heartbeat(job: WorkerJob, rank: int) -> None:
    """Touch ``rank-<rank>.alive`` every ``HEARTBEAT_S`` seconds from a daemon thread."""
    path = marker(job, rank, "alive")

    def beat() -> None:
        while True:
            try:
                path.touch()
            except OSError:
                pass  # the launch is being torn down
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="retexo-heartbeat", daemon=True).start()


def listening_socket(addr: str, port: int) -> int:
    """A TCP socket bound to ``addr:port`` only (not every interface), listening; its file descriptor,
    which the caller owns. ``OSError`` when the address is taken or not this machine's."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    server = socket.socket(family, kind, proto)
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(where)
        server.listen(socket.SOMAXCONN)
    except OSError:
        server.close()
        raise
    return server.detach()


def connect_rendezvous(job: WorkerJob, host: bool, timeout: timedelta | None = None,
                       **options: object):  # -> torch.distributed.TCPStore
    """The launch's key-value store at ``master_addr:master_port``, hosted by this process when ``host``
    (a client's operations wait up to ``timeout``, by default the job's).
    The host listens on ``master_addr`` only: torch's own server would listen on every interface."""
    import torch.distributed as dist

    if not host:
        return dist.TCPStore(job.master_addr, job.master_port, is_master=False, timeout=timeout or job.timeout,
                             **options)
    try:
        fd = listening_socket(job.master_addr, job.master_port)
    except OSError as exc:
        raise dist.DistNetworkError(f"cannot listen on {job.master_addr}:{job.master_port}: {exc}") from exc
    try:
        return dist.TCPStore(job.master_addr, job.master_port, is_master=True, timeout=job.timeout,
                             master_listen_fd=fd, **options)
    except BaseException:
        with suppress(OSError):  # closed already if the server had taken it
            os.close(fd)
        raise


def join_process_group(job: WorkerJob, rank: int):  # -> torch.distributed.TCPStore
    """Connect to the rendezvous and form the gloo process group; ``RendezvousTimeout`` when the
    other ranks did not all arrive within the configured timeout."""
    import torch.distributed as dist

    marker(job, rank, "joining").touch()
    try:
        rendezvous = connect_rendezvous(job, host=rank == 0 and not job.launcher_hosts_rendezvous)
        if rendezvous.add(f"retexo/seat/{rank}", 1) > 1:  # a seat per rank: the second claimant is refused
            raise RankTaken(f"rank {rank} is taken: another process joined {job.master_addr}:{job.master_port} "
                            f"as rank {rank} first (each site or node needs its own --rank / --node-rank)")
        dist.init_process_group("gloo", store=dist.PrefixStore("gen0", rendezvous), rank=rank,
                                world_size=job.world, timeout=job.timeout)
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, dist.DistStoreError) or "timed out" in text.lower() or "timeout" in text.lower():
            raise RendezvousTimeout(f"rank {rank}: the process group did not form within "
                                    f"{job.config.timeout_s:g} s ({text})") from exc
        raise
    marker(job, rank, "joined").touch()
    return rendezvous


def join_sites(job: WorkerJob, rank: int):  # -> tuple[SiteMesh, MeshTransport]
    """Form the sites' mesh of mutually authenticated TLS links with the job's kit
    (``retexo_core.comm.mesh``); ``SiteRefused`` (one line) when this site cannot join."""
    from retexo_core.comm.mesh import MeshTransport, SiteMesh
    from retexo_core.comm.tls import Kit

    marker(job, rank, "joining").touch()
    mesh = SiteMesh.form(Kit.open(Path(job.kit or "")), rank, job.world, job.master_addr, job.master_port,
                         job.config.timeout_s, job.config.hang_timeout_s)
    marker(job, rank, "joined").touch()
    return mesh, MeshTransport(mesh)


def log_path(store_root: str, run_fp: str, rank: int) -> Path:
    """Per-rank log file of a run (appended to by every launch)."""
    return Store(Path(store_root)).run_dir(run_fp) / "logs" / f"rank-{rank}.log"


@contextmanager
def core_logs_to_files() -> Iterator[None]:
    """While ranks run: the core's records (logger ``retexo``) at INFO go to the rank log files
    only, not to the launcher's console handlers."""
    logger = logging.getLogger("retexo")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate


@contextmanager
def rank_log(job: WorkerJob, rank: int, thread: str | None = None) -> Iterator[None]:
    """Send the core's log records of this rank to its log file; with ``thread`` only the records
    of that thread (ranks run as threads share the process's loggers)."""
    path = log_path(job.store_root, job.run_fp, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank={rank} %(levelname)s %(message)s"))
    if thread is not None:
        handler.addFilter(lambda record: record.threadName == thread)
    logger = logging.getLogger("retexo")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()


def load_data(job: WorkerJob, rank: int) -> PartData:
    from retexo_core.data import load_part, load_whole_graph

    source = Path(job.source_dir)
    if job.site:
        return load_part(source, 0)  # a site partition has one part, this site's
    return load_whole_graph(source) if job.whole_graph else load_part(source, rank)


def meet_sites(comm: Communicator, job: WorkerJob, data: PartData) -> tuple[PartData, tuple[StageSpec, ...]]:
    """A site's rank meets the others (``retexo_core.sites``): the options, widths and classes are
    checked and the first layer to train agreed (the earliest one some site has not committed),
    then the owners of its remote sources are discovered. Returns this site's part of the K-part graph and
    the stages to train."""
    import dataclasses

    from graphstore.lookup import layer_fp_of
    from retexo_core.sites import SITE_EPOCH, agree, discover_owners, remote_ids, with_owners

    comm.layer, comm.epoch = 0, SITE_EPOCH
    unfinished = [s.layer for s in job.stages if layer_fp_of(Path(s.target)) != s.fp]
    first = min(unfinished, default=job.config.layers + 1)
    agreed = agree(comm, data, job.config.run_payload(), first)
    remote = remote_ids(data)
    data = with_owners(data, comm.rank, comm.world, remote, discover_owners(comm, data.node_id, remote))
    comm.epoch = -1
    data = dataclasses.replace(data, num_classes=agreed.num_classes, features_nonnegative=agreed.features_nonnegative)
    first = agreed.start_layer if job.config.is_layerwise else min(agreed.start_layer, 1)
    return data, tuple(s for s in job.stages if s.layer >= first and agreed.start_layer <= job.config.layers)


def run_rank(job: WorkerJob, rank: int, transport: Transport | None, rendezvous: object = None) -> None:
    """Train the launch's layers as rank ``rank`` and write the results through a ``RunFolder``."""
    from retexo_core.comm.communicator import Communicator
    from retexo_core.data import load_part
    from retexo_core.device import compute_device
    from retexo_core.stages import train_stages
    from runner.results import RunFolder

    device = compute_device(job.config.device, rank)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)  # this thread's current GPU (cuSPARSE handles, streams)
    comm = Communicator(rank, job.world, job.timeout, job.config.compress, job.network, transport,
                        skip_zero_grads=job.config.skip_zero_grads)
    comm.rendezvous = rendezvous
    data, stages = load_data(job, rank), job.stages
    if job.site:
        data, stages = meet_sites(comm, job, data)
        if not stages:
            return  # every site has every layer
        if job.config.secure_agg:
            from retexo_core.comm.secure_agg import PairwiseMasks

            comm.masks = PairwiseMasks.agree(comm)
    sink = RunFolder(job.store_root, job.run_fp, job.config, job.world, stages, job.network if job.site else None)
    refresh = [Path(d) for d in job.refresh_dirs]
    train_stages(comm, data, job.config, [s.layer for s in stages], sink,
                 lambda period: load_part(refresh[period - 1], rank), device)


def install_open_audit(job: WorkerJob) -> list[str]:
    """Record every file this process opens from now on (Python audit hook), outside the Python
    installation: the residency audit then shows which stores' files a rank read."""
    installation = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    opened: list[str] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if not path.startswith(installation):
                opened.append(path)

    sys.addaudithook(hook)
    return opened


def process_main(job: WorkerJob, rank: int) -> None:
    """Entry point of a spawned worker process (torchrun-style env: RANK, WORLD_SIZE, MASTER_*).
    It holds the run first (``WorkerJob.holds_run``), so that its launcher's guard never finds
    the run unheld while this process may still write to the store."""
    with hold_run(Store(Path(job.store_root)), job.run_fp) if job.holds_run else nullcontext():
        train_in_process(job, rank)


def train_in_process(job: WorkerJob, rank: int) -> None:
    """The worker process's work; the launcher watch and the heartbeat start before torch is
    imported (seconds)."""
    watch_launcher(rank)
    start_heartbeat(job, rank)
    marker(job, rank, "started").write_text(f"{os.getpid()}\n")

    import torch
    import torch.distributed as dist

    import retexo_core.sites  # noqa: F401  (the training core, imported before the prefetch below)
    import retexo_core.stages  # noqa: F401
    from retexo_core.comm.transport import GlooTransport

    opened = install_open_audit(job) if job.audit_dir else []
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(job.world), MASTER_ADDR=job.master_addr,
                      MASTER_PORT=str(job.master_port))
    if job.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(job.threads)
    with core_logs_to_files(), rank_log(job, rank):
        mesh, failure = None, ""
        try:
            rendezvous, transport = None, None
            if job.world > 1 and job.kit is not None:
                mesh, transport = join_sites(job, rank)
            elif job.world > 1:
                rendezvous = join_process_group(job, rank)
                transport = GlooTransport()
            else:
                marker(job, rank, "joined").touch()
            prefetch_import("torch._dynamo")  # torch.optim imports it at its first use (about 1 s of CPU)
            if mesh is not None:
                run_rank(job, rank, transport)  # the mesh names a site that goes away or freezes
            else:
                run_watched(job, rank, transport, rendezvous)
        except BaseException as exc:
            error_file(job, rank).write_text(traceback.format_exc())
            logging.getLogger("retexo.worker").exception("worker failed")
            cause = exc.__cause__ or exc  # a failed collective: what the transport said
            failure = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise
        finally:
            if mesh is not None:
                mesh.close(failure)
            if job.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
            if job.audit_dir:
                Path(job.audit_dir, f"rank-{rank}.txt").write_text("\n".join(opened) + "\n")
    exit_now()


def run_watched(job: WorkerJob, rank: int, transport: Transport | None, rendezvous: object) -> None:
    """``run_rank``; a site's rank also beats and watches the other sites (``runner.site_watch``),
    so that a failed collective names the site that went away and a frozen site stops the run."""
    if not (job.site and job.world > 1):
        run_rank(job, rank, transport, rendezvous)
        return
    from retexo_core.comm.communicator import CommunicationError
    from runner.site_watch import SiteWatch, end_process

    watch = SiteWatch(lambda timeout: connect_rendezvous(job, host=False, timeout=timeout), rank, job.world,
                      job.config.hang_timeout_s, lambda line: end_process(str(error_file(job, rank)), line))
    try:
        run_rank(job, rank, transport, rendezvous)
    except CommunicationError as exc:  # every collective's failure (not a site mismatch: no peer to wait for)
        lost = watch.lost(exc)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        watch.finish()


def prefetch_import(module: str) -> None:
    """Import ``module`` in a daemon thread, so that its import overlaps this rank's waits for its
    peers (discovery, the first halo exchange: gloo waits release the GIL) instead of delaying the
    first training step. Started once the rank's own imports are done and the process group has
    formed (it would delay the rendezvous of a peer that shares this CPU)."""
    threading.Thread(target=importlib.import_module, args=(module,), name="retexo-prefetch", daemon=True).start()


def exit_now() -> NoReturn:
    """End a worker that has finished: logs and output streams are flushed, then ``os._exit(0)``.
    Everything it wrote is committed by now; the interpreter's own teardown (torch and gloo
    destructors) would otherwise keep the process, and so the launcher, waiting for over a second."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def thread_main(job: WorkerJob, rank: int, transport: Transport, failed: threading.Event) -> None:
    """Body of a rank run as a thread of the launcher; a failure is reported in the rank's error file."""
    import torch

    torch.set_num_threads(job.threads)  # per thread: each rank thread has its own OpenMP team
    with rank_log(job, rank, threading.current_thread().name):
        try:
            run_rank(job, rank, transport)
        except BaseException:
            error_file(job, rank).write_text(traceback.format_exc())
            logging.getLogger("retexo.worker").exception("worker failed")
            failed.set()
