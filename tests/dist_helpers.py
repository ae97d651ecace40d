"""Run a function on K ranks, collecting return values and comm log rows.

Two ways with the same result shape: ``run_ranks`` spawns a real gloo process group (one process
per rank; seconds, since every process imports torch), ``run_threads`` runs the ranks as threads of
this process over a ``ThreadHub`` (milliseconds). ``run_ranks_batch`` runs several functions in one
spawned group, each with a fresh communicator, to pay for the spawn once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from retexo_core.comm.communicator import Communicator
from retexo_core.comm.transport import ThreadHub

TIMEOUT = timedelta(seconds=60)

RankFn = Callable[[Communicator], Any]


def _rank_main(calls: Sequence[tuple[RankFn, str]], rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        outputs = []
        for fn, compression in calls:
            comm = Communicator(rank, world, TIMEOUT, compression)  # type: ignore[arg-type]
            outputs.append((fn(comm), comm.log.rows))
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(outputs))
    finally:
        dist.destroy_process_group()


def run_ranks_batch(calls: Sequence[tuple[RankFn, str]], world: int) -> list[list[tuple[Any, list]]]:
    """For each (fn, compression) of ``calls``, in order, on one spawned gloo group of ``world``
    processes: [(fn's return value, the rank's comm log rows) for each rank]. ``fn`` must be a
    module-level function (it is pickled)."""
    # imported here, not at the top: every spawned rank imports this module, and the launcher
    # (worker, strategies, torch_geometric) would add seconds to each of them
    from runner.launch import free_port, lean_main

    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(list(calls), r, world, port, out)) for r in range(world)]
        with lean_main():
            for p in procs:
                p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        per_rank = [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
    return [[per_rank[r][i] for r in range(world)] for i in range(len(calls))]


def run_ranks(fn: RankFn, world: int, compression: str = "none") -> list[tuple[Any, list]]:
    """[(fn's return value, the rank's comm log rows)] for ranks 0..world-1 of a gloo process group."""
    return run_ranks_batch([(fn, compression)], world)[0]


def run_threads(fn: RankFn, world: int, compression: str = "none",
                timeout: timedelta = TIMEOUT) -> list[tuple[Any, list]]:
    """[(fn's return value, the rank's comm log rows)] for ranks 0..world-1, run as threads of this
    process over one ``ThreadHub``.

    If a rank raises, the hub is aborted (its peers stop waiting at once) and the first exception
    raised is re-raised here.
    """
    hub = ThreadHub(world)
    comms = [Communicator(r, world, timeout, compression, transport=hub.transport(r))  # type: ignore[arg-type]
             for r in range(world)]
    results: list[Any] = [None] * world
    failures: list[BaseException] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            with lock:
                failures.append(exc)
            hub.abort(f"rank {rank} failed: {exc!r}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * timeout.total_seconds())
    if any(thread.is_alive() for thread in threads):
        hub.abort("run_threads gave up waiting")
        raise TimeoutError(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} did not finish")
    if failures:
        raise failures[0]
    return [(results[r], comms[r].log.rows) for r in range(world)]
