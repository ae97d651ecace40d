"""What one rank runs: as a spawned process (``process_main``) or as a thread of the launcher
(``thread_main``, for tests and tiny runs). Both end in ``run_rank``: build the communicator, read
this rank's partition, and let ``retexo_core.stages`` train the launch's layers.

A worker reads only ``part=<rank>`` of the partition (plus the partition manifest) and its own rows
of earlier layers; everything else arrives through the communicator and is counted.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from typing import TYPE_CHECKING

from graphstore.layout import Store
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.results import StageSpec

if TYPE_CHECKING:  # the training core (torch) is imported by the ranks only, not by the launcher
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
    refresh_dirs: tuple[str, ...] = field(default_factory=tuple)  # grappa: partitions of refresh periods 1, 2, ...

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.config.timeout_s)


def error_file(job: WorkerJob, rank: int) -> Path:
    return Path(job.error_dir) / f"rank-{rank}.txt"


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
    return load_whole_graph(source) if job.whole_graph else load_part(source, rank)


def run_rank(job: WorkerJob, rank: int, transport: Transport | None, rendezvous: object = None) -> None:
    """Train the launch's layers as rank ``rank`` and write the results through a ``RunFolder``."""
    from retexo_core.comm.communicator import Communicator
    from retexo_core.data import load_part
    from retexo_core.stages import train_stages
    from runner.results import RunFolder

    comm = Communicator(rank, job.world, job.timeout, job.config.compress, job.network, transport)
    comm.rendezvous = rendezvous
    sink = RunFolder(job.store_root, job.run_fp, job.config, job.world, job.stages)
    refresh = [Path(d) for d in job.refresh_dirs]
    train_stages(comm, load_data(job, rank), job.config, [s.layer for s in job.stages], sink,
                 lambda period: load_part(refresh[period - 1], rank))


def install_open_audit(job: WorkerJob) -> list[str]:
    """Record every file under the store that this process opens (Python audit hook)."""
    root = str(Path(job.store_root).resolve())
    opened: list[str] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if path.startswith(root):
                opened.append(path)

    sys.addaudithook(hook)
    return opened


def process_main(job: WorkerJob, rank: int) -> None:
    """Entry point of a spawned worker process (torchrun-style env: RANK, WORLD_SIZE, MASTER_*)."""
    import torch
    import torch.distributed as dist

    from retexo_core.comm.transport import GlooTransport

    opened = install_open_audit(job) if job.audit_dir else []
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(job.world), MASTER_ADDR=job.master_addr,
                      MASTER_PORT=str(job.master_port))
    if job.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(job.threads)
    with core_logs_to_files(), rank_log(job, rank):
        try:
            rendezvous, transport = None, None
            if job.world > 1:
                hosts = rank == 0 and not job.launcher_hosts_rendezvous
                rendezvous = dist.TCPStore(job.master_addr, job.master_port, is_master=hosts, timeout=job.timeout)
                dist.init_process_group("gloo", store=dist.PrefixStore("gen0", rendezvous), rank=rank,
                                        world_size=job.world, timeout=job.timeout)
                transport = GlooTransport()
            run_rank(job, rank, transport, rendezvous)
        except BaseException:
            error_file(job, rank).write_text(traceback.format_exc())
            logging.getLogger("retexo.worker").exception("worker failed")
            raise
        finally:
            if job.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
            if job.audit_dir:
                Path(job.audit_dir, f"rank-{rank}.txt").write_text("\n".join(opened) + "\n")


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
