"""Starting the ranks of one launch and watching them: fail fast and name the rank to blame.

``processes`` (the default): this node's ranks are spawned processes of a gloo process group, with
the rendezvous hosted by rank 0, or by node 0's launcher when a tolerant strategy must be able to
re-form the group after losing a rank (then the store must outlive any rank). ``threads``: all ranks are threads of this process
talking through an in-process transport with the same byte accounting (for tests and tiny runs;
single node only). Either way the launcher polls its ranks; as soon as one fails it gives the
others a short grace period to report, stops the rest and raises ``WorkerFailed`` naming the rank
that failed first (a rank killed by a signal, or one that raised something other than a
communication error, is the cause, though a rank gloo aborted (SIGABRT) after losing a peer comes
after one that raised; ranks still running when their peers timed out are named as hung; when the
process group did not form, the rank that never reached the rendezvous).

Hangs. A stopped or wedged worker would only show up when its peers' collectives time out, and
that timeout (``--timeout``, 300 s) must stay long: a legitimately slow rank, e.g. one with a big
first layer, keeps its peers waiting in a collective for as long as it computes. So the launcher
watches its worker processes itself (``HangWatch``): a worker is hung when for
``--hang-timeout`` seconds (20 s by default) it has neither touched its heartbeat file (a daemon
thread does every second) nor used any CPU time (``psutil``). A busy rank uses CPU and
a waiting one beats, so only a stopped or stuck process is caught, within seconds of the timeout,
before or after the process group formed, and named in one line.

Ceiling. A node runs at most ``worker_ceiling()`` worker processes (a torch worker holds 250-400
MB): ``min(64, available memory / 400 MB)``, or ``RETEXO_MAX_WORKERS``; more are refused before
anything is spawned (``check_worker_processes``).

The workers are started inside the ``try`` whose ``finally`` kills them, so an interrupt during
start-up leaves no process behind; and a worker never outlives this launcher (``runner.worker``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Literal, Protocol

from graphstore.errors import RetexoError
from graphstore.limits import WORKER_BASE, available_memory
from graphstore.units import human_bytes
from runner.worker import (WorkerJob, connect_rendezvous, core_logs_to_files, error_file, marker, process_main,
                           thread_main)

GRACE_SECONDS = 5.0
HANG_CHECK_S = 1.0  # seconds between two looks at the workers' heartbeats and CPU time
MAX_WORKERS = 64  # hard cap of worker processes per machine, whatever its memory
MAX_WORKERS_ENV = "RETEXO_MAX_WORKERS"
Launcher = Literal["processes", "threads"]

log = logging.getLogger(__name__)


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


def worker_ceiling() -> tuple[int, str]:
    """(most worker processes this machine may run, why): ``RETEXO_MAX_WORKERS`` when set, else
    ``min(MAX_WORKERS, available memory // WORKER_BASE)`` (at least 1)."""
    value = os.environ.get(MAX_WORKERS_ENV)
    if value is not None:
        try:
            ceiling = int(value)
        except ValueError:
            ceiling = 0
        if ceiling < 1:
            raise RetexoError(f"{MAX_WORKERS_ENV} must be a positive whole number of worker processes, not '{value}'")
        return ceiling, f"{MAX_WORKERS_ENV}={ceiling}"
    memory = available_memory()
    fit = max(1, memory // WORKER_BASE)
    if fit >= MAX_WORKERS:
        return MAX_WORKERS, f"hard cap {MAX_WORKERS}"
    return fit, f"{human_bytes(memory)} available, {human_bytes(WORKER_BASE)} per worker"


def check_worker_processes(count: int) -> None:
    """Refuse (``RetexoError``, one line saying what to do) to run ``count`` worker processes on
    this machine when that is more than ``worker_ceiling()``; checked before anything is spawned."""
    ceiling, why = worker_ceiling()
    if count > ceiling:
        raise RetexoError(
            f"{count} worker processes would exceed this machine's ceiling of {ceiling} ({why}): use fewer "
            f"--parts, spread the ranks over more machines (retexo worker --nnodes), run tiny graphs with the "
            f"threads launcher (Python API), or set {MAX_WORKERS_ENV} to change the ceiling")


def default_threads(local_ranks: int) -> int:
    """Torch threads per worker so that the workers of one node share the CPUs this launcher may
    run on (its affinity: a cpuset, ``taskset``, or several emulated nodes pinned apart)."""
    return max(1, len(os.sched_getaffinity(0)) // max(local_ranks, 1))


def _last_line(path: Path) -> str:
    lines = path.read_text().strip().splitlines() if path.is_file() else []
    return lines[-1] if lines else ""


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _never_joined(job: WorkerJob, local: list[int], failed: dict[int, int]) -> tuple[int, str]:
    """(rank to blame, cause) when the process group did not form: a local rank that never
    reached the rendezvous, else the ranks of other nodes."""
    within = f"within {job.config.timeout_s:g} s"
    for rank in local:
        if rank in failed or marker(job, rank, "joining").exists():
            continue
        how = "it started but never reached the rendezvous" if marker(job, rank, "started").exists() else "it was spawned but never started running"
        return rank, f"never joined the process group {within} ({how})"
    remote = [r for r in range(job.world) if r not in local]
    if remote:
        return remote[0], (f"never joined the process group {within} (or another of {_ranks_text(remote)} on "
                           f"other machines; every rank of this machine arrived)")
    return min(failed), f"never joined the process group {within}"


def _describe(job: WorkerJob, failed: dict[int, int], alive: list[int], local: list[int]) -> tuple[int, str]:
    """(rank to blame, message) from exit codes, error files, markers and ranks still running."""
    reports = {rank: _last_line(error_file(job, rank)) for rank in failed}
    waited = {r for r in failed if "CommunicationError" in reports[r] or "RendezvousTimeout" in reports[r]}
    killed = [r for r, code in failed.items() if code < 0 or not reports[r]]
    crashed = [r for r in failed if reports[r] and r not in waited]
    # gloo aborts a rank (SIGABRT) whose peer went away: a rank that raised is the likelier cause
    hard = [r for r in killed if failed[r] != -signal.SIGABRT]
    if hard or (killed and not crashed):
        rank = (hard or killed)[0]
        code = failed[rank]
        cause = f"was killed by signal {-code}" if code < 0 else f"exited with code {code} without a report"
    elif crashed:
        rank = crashed[0]
        cause = f"failed: {reports[rank]}"
    elif any("RendezvousTimeout" in reports[r] for r in failed):
        rank, cause = _never_joined(job, local, failed)
    elif alive:
        rank = alive[0]
        cause = "stopped responding (its peers timed out waiting for it)"
    else:
        rank = min(failed)
        cause = f"failed: {reports[rank]}"
    others = [f"rank {r}: {reports[r] or f'exit code {failed[r]}'}" for r in sorted(failed) if r != rank and r not in waited]
    waiting = sorted(r for r in waited if r != rank)
    if waiting:
        others.append(f"{_ranks_text(waiting)} failed waiting for it")
    message = f"worker rank {rank} {cause}"
    if others:
        message += f" (then {', '.join(others)})"
    return rank, message


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far (s; 10 ms steps), None when unknown."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return times.user + times.system


class HangWatch:
    """Names the worker processes that show no sign of life for ``hang_s`` seconds: neither a
    new heartbeat (``rank-<r>.alive`` touched) nor any CPU time used (see the module docstring).

    Compares what it sees between looks, never clocks of different processes; a worker counts
    from its spawn, so one stopped before its first heartbeat is caught as well."""

    def __init__(self, job: WorkerJob, hang_s: float):
        self.job = job
        self.hang_s = hang_s
        self.seen: dict[int, tuple[object, float]] = {}  # rank -> (last sign of life, when it changed)
        self.next_look = 0.0

    def spawned(self, rank: int) -> None:
        self.seen[rank] = (None, time.monotonic())

    def hung(self, handles: dict[int, Rank]) -> list[int]:
        """Ranks alive but silent for ``hang_s`` seconds (looks at most every ``HANG_CHECK_S``)."""
        now = time.monotonic()
        if now < self.next_look:
            return []
        self.next_look = now + HANG_CHECK_S
        silent = []
        for rank, (last, since) in self.seen.items():
            handle = handles[rank]
            pid = getattr(handle, "pid", None)
            if pid is None or not handle.is_alive():
                continue
            try:
                beat: int | None = marker(self.job, rank, "alive").stat().st_mtime_ns
            except FileNotFoundError:
                beat = None  # no heartbeat yet
            sign = (beat, cpu_seconds(pid))
            if sign != last:
                self.seen[rank] = (sign, now)
            elif now - since > self.hang_s:
                silent.append(rank)
        return silent

    def describe(self, rank: int) -> str:
        silence = f"no heartbeat and no CPU time for {self.hang_s:g} s"
        if marker(self.job, rank, "joined").exists():
            return f"worker rank {rank} stopped responding during training ({silence}; stopped or stuck)"
        if not marker(self.job, rank, "started").exists():
            where = "before it started"
        elif not marker(self.job, rank, "joining").exists():
            where = "while starting"
        else:
            where = "at the rendezvous"
        return f"worker rank {rank} never joined the process group: it stopped responding {where} ({silence})"


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
    try:
        return connect_rendezvous(job, host=True, wait_for_workers=False)
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


def make_ranks(job: WorkerJob, ranks: list[int], launcher: Launcher) -> dict[int, Rank]:
    """This node's ranks, not started yet."""
    if launcher == "threads":
        from retexo_core.comm.transport import ThreadHub

        if len(ranks) != job.world:
            raise RetexoError("the threads launcher runs every rank on one node (nnodes = 1)")
        hub = ThreadHub(job.world)
        return {rank: ThreadRank(job, rank, hub) for rank in ranks}
    context = mp.get_context("spawn")
    return {rank: context.Process(target=process_main, args=(job, rank), name=f"retexo-rank-{rank}")
            for rank in ranks}


def run_workers(job: WorkerJob, ranks: list[int], host: bool = True, launcher: Launcher = "processes",
                watch: Callable[[], None] | None = None, poll_seconds: float = 0.1) -> list[int]:
    """Run ``ranks`` of ``job`` and wait; raise ``WorkerFailed`` if any rank fails or hangs.

    ``host``: this is node 0's launcher, which hosts the rendezvous store when the job says so.
    ``watch`` is called at every poll (e.g. to report layers as they are committed). With
    ``config.tolerate_failures`` a failed rank is dropped instead: the survivors' membership is
    published and the run goes on; returns the dropped ranks. A hung worker process (``HangWatch``)
    fails the run, or is killed and dropped with ``tolerate_failures``. However this returns or
    raises (an interrupt included), every started rank has been stopped.
    """
    if launcher == "processes":
        check_worker_processes(len(ranks))
    Path(job.error_dir).mkdir(parents=True, exist_ok=True)
    hosting = host and launcher == "processes" and job.world > 1 and job.launcher_hosts_rendezvous
    store = rendezvous_store(job) if hosting else None
    tolerate = job.config.tolerate_failures and store is not None
    hang = HangWatch(job, job.config.hang_timeout_s) if launcher == "processes" else None
    dropped: list[int] = []
    generation = 0
    with core_logs_to_files() if launcher == "threads" else nullcontext():
        handles = make_ranks(job, ranks, launcher)
        started: list[Rank] = []
        failed: dict[int, int] = {}
        try:
            with lean_main():
                for rank, handle in handles.items():
                    handle.start()
                    started.append(handle)
                    if hang is not None:
                        hang.spawned(rank)
            while True:
                if watch is not None:
                    watch()
                for rank in hang.hung(handles) if hang is not None else []:
                    if not tolerate:
                        raise WorkerFailed(rank, hang.describe(rank))  # type: ignore[union-attr]
                    log.warning("%s; killing it", hang.describe(rank))  # type: ignore[union-attr]
                    handles[rank].kill()
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
                    raise WorkerFailed(*_describe(job, failed, alive, ranks))
                if not alive:
                    if watch is not None:
                        watch()
                    if all(h.exitcode == 0 for r, h in handles.items() if r not in dropped):
                        return dropped
                    raise WorkerFailed(*_describe(job, failed, [], ranks))
                time.sleep(poll_seconds)
        finally:
            for handle in started:
                if handle.is_alive():
                    handle.kill()
            for handle in started:
                handle.join(timeout=5)
