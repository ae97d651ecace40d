"""Starting the ranks of one launch and watching them: fail fast and name the rank to blame.

``processes`` (the default): this node's ranks are spawned processes of a gloo process group, with
the rendezvous hosted by rank 0, or by node 0's launcher when a tolerant strategy must be able to
re-form the group after losing a rank (then the store must outlive any rank). ``threads``: all ranks are threads of this process
talking through an in-process transport with the same byte accounting (for tests and tiny runs;
single node only). Either way the launcher polls its ranks; as soon as one fails it gives the
others a short grace period to report, stops the rest and raises ``WorkerFailed`` naming the rank
that failed first (a rank killed by a signal, or one that raised something other than a
communication error, is the cause; ranks still running when their peers timed out are named as
hung).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Literal, Protocol

from graphstore.errors import RetexoError
from runner.worker import WorkerJob, core_logs_to_files, error_file, process_main, thread_main

GRACE_SECONDS = 5.0
Launcher = Literal["processes", "threads"]


class WorkerFailed(RetexoError):
    """A worker of the process group failed; ``rank`` is the one identified as the cause."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(message)


class Rank(Protocol):
    """A running rank (a ``multiprocessing.Process`` or a ``ThreadRank``)."""

    exitcode: int | None

    def start(self) -> None: ...
    def is_alive(self) -> bool: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (chosen afresh for every attempt)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def node_ranks(world: int, nnodes: int, node_rank: int) -> list[int]:
    """The contiguous block of ranks that node ``node_rank`` of ``nnodes`` runs."""
    if not 0 <= node_rank < nnodes:
        raise RetexoError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
    if nnodes > world:
        raise RetexoError(f"{nnodes} nodes for {world} partitions: every node needs at least one partition")
    return list(range(world * node_rank // nnodes, world * (node_rank + 1) // nnodes))


def default_threads(local_ranks: int) -> int:
    """Torch threads per worker so that the workers of one node share its cores."""
    return max(1, (os.cpu_count() or 1) // max(local_ranks, 1))


def _describe(job: WorkerJob, failed: dict[int, int], alive: list[int]) -> tuple[int, str]:
    """(rank to blame, message) from exit codes, error files and ranks still running."""
    reports = {}
    for rank in failed:
        path = error_file(job, rank)
        reports[rank] = path.read_text().strip().splitlines()[-1] if path.is_file() else ""
    killed = [r for r, code in failed.items() if code < 0 or not reports[r]]
    crashed = [r for r in failed if reports[r] and "CommunicationError" not in reports[r]]
    if killed:
        rank = killed[0]
        code = failed[rank]
        cause = f"was killed by signal {-code}" if code < 0 else f"exited with code {code} without a report"
    elif crashed:
        rank = crashed[0]
        cause = f"failed: {reports[rank]}"
    elif alive:
        rank = alive[0]
        cause = "stopped responding (its peers timed out waiting for it)"
    else:
        rank = min(failed)
        cause = f"failed: {reports[rank]}"
    others = ", ".join(f"rank {r}: {reports[r] or f'exit code {failed[r]}'}" for r in sorted(failed) if r != rank)
    message = f"worker rank {rank} {cause}"
    if others:
        message += f" (then {others})"
    return rank, message


@contextmanager
def lean_main() -> Iterator[None]:
    """Hide the parent's ``__main__`` while starting spawn children.

    ``spawn`` re-imports the parent's main module in every child; when the parent is the CLI, a
    Prefect worker or pytest that drags in heavy, irrelevant imports (seconds per rank). The
    workers' target lives in ``runner.worker`` and needs nothing from ``__main__``.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def rendezvous_store(job: WorkerJob):  # -> torch.distributed.TCPStore
    """The key-value store the process group forms through, hosted by node 0's launcher for tolerant
    strategies (so it outlives any worker and can publish the survivors when one is lost)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(job.master_addr, job.master_port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=job.config.timeout_s))
    except (RuntimeError, OSError) as exc:
        raise WorkerFailed(-1, f"cannot host the rendezvous on {job.master_addr}:{job.master_port}: "
                               f"address already in use or unavailable ({exc})") from exc


class ThreadRank:
    """A rank run as a thread of the launcher over the in-process transport."""

    def __init__(self, job: WorkerJob, rank: int, hub: object):
        self.hub = hub
        self.failed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"retexo-rank-{rank}", daemon=True, args=(job, rank))

    def _run(self, job: WorkerJob, rank: int) -> None:
        thread_main(job, rank, self.hub.transport(rank), self.failed)  # type: ignore[attr-defined]
        if self.failed.is_set():  # release the peers waiting for this rank at once
            self.hub.abort(f"rank {rank} failed")  # type: ignore[attr-defined]

    @property
    def exitcode(self) -> int | None:
        return None if self.thread.is_alive() else (1 if self.failed.is_set() else 0)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def kill(self) -> None:
        self.hub.abort("the launcher stopped this rank")  # type: ignore[attr-defined]

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def start_ranks(job: WorkerJob, ranks: list[int], launcher: Launcher) -> dict[int, Rank]:
    if launcher == "threads":
        from retexo_core.comm.transport import ThreadHub

        if len(ranks) != job.world:
            raise RetexoError("the threads launcher runs every rank on one node (nnodes = 1)")
        hub = ThreadHub(job.world)
        started: dict[int, Rank] = {rank: ThreadRank(job, rank, hub) for rank in ranks}
        for handle in started.values():
            handle.start()
        return started
    context = mp.get_context("spawn")
    processes: dict[int, Rank] = {rank: context.Process(target=process_main, args=(job, rank), name=f"retexo-rank-{rank}")
                                  for rank in ranks}
    with lean_main():
        for process in processes.values():
            process.start()
    return processes


def run_workers(job: WorkerJob, ranks: list[int], host: bool = True, launcher: Launcher = "processes",
                watch: Callable[[], None] | None = None, poll_seconds: float = 0.1) -> list[int]:
    """Run ``ranks`` of ``job`` and wait; raise ``WorkerFailed`` if any rank fails.

    ``host``: this is node 0's launcher, which hosts the rendezvous store when the job says so.
    ``watch`` is called at every poll (e.g. to report layers as they are committed). With
    ``config.tolerate_failures`` a failed rank is dropped instead: the survivors' membership is
    published and the run goes on; returns the dropped ranks.
    """
    Path(job.error_dir).mkdir(parents=True, exist_ok=True)
    hosting = host and launcher == "processes" and job.world > 1 and job.launcher_hosts_rendezvous
    store = rendezvous_store(job) if hosting else None
    tolerate = job.config.tolerate_failures and store is not None
    dropped: list[int] = []
    generation = 0
    with core_logs_to_files() if launcher == "threads" else nullcontext():
        handles = start_ranks(job, ranks, launcher)
        failed: dict[int, int] = {}
        try:
            while True:
                if watch is not None:
                    watch()
                for rank, handle in handles.items():
                    if rank not in failed and handle.exitcode not in (None, 0):
                        failed[rank] = handle.exitcode  # type: ignore[assignment]
                alive = [r for r, h in handles.items() if h.exitcode is None]
                if tolerate and failed and alive and len(failed) > len(dropped):
                    dropped, generation = sorted(failed), generation + 1
                    survivors = [r for r in range(job.world) if r not in dropped]
                    store.set(f"members/{generation}", ",".join(map(str, survivors)))  # type: ignore[union-attr]
                    continue
                if failed and not tolerate:
                    deadline = time.monotonic() + GRACE_SECONDS
                    while time.monotonic() < deadline and any(h.is_alive() for h in handles.values()):
                        time.sleep(poll_seconds)
                    for rank, handle in handles.items():
                        if rank not in failed and handle.exitcode not in (None, 0):
                            failed[rank] = handle.exitcode  # type: ignore[assignment]
                    alive = [r for r, h in handles.items() if h.is_alive()]
                    raise WorkerFailed(*_describe(job, failed, alive))
                if not alive:
                    if watch is not None:
                        watch()
                    if all(h.exitcode == 0 for r, h in handles.items() if r not in dropped):
                        return dropped
                    raise WorkerFailed(*_describe(job, failed, []))
                time.sleep(poll_seconds)
        finally:
            for handle in handles.values():
                if handle.is_alive():
                    handle.kill()
                handle.join(timeout=5)
