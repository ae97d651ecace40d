"""Run several commands at once and wait for all of them (tests and benchmarks that start sites);
read the command line of a process that may be exiting meanwhile."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def run_together(commands: list[list[str]], env: dict[str, str], timeout: float,
                 preexec_fns: Sequence[Callable[[], None] | None] | None = None,
                 ) -> list[subprocess.CompletedProcess[str]]:
    """Start every command at once (from the repository, stdin closed; command k runs
    ``preexec_fns[k]`` in the child before it starts), wait for all of them (each within ``timeout``
    s) and kill whatever is left, also when waiting fails."""
    setups = preexec_fns if preexec_fns is not None else [None] * len(commands)
    procs = [subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=setup)
             for command, setup in zip(commands, setups, strict=True)]
    outputs = communicate_all(procs, timeout)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def communicate_all(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process once all have exited, each within ``timeout`` s; whatever
    is left is killed, also when waiting fails.

    The pipes of all of them are read at once: waiting on one process while another's full pipe
    blocks it (its peers then wait on it in a collective) would hang both.
    """
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = [pool.submit(p.communicate, timeout=timeout) for p in procs]
        try:
            return [f.result() for f in futures]
        finally:
            for p in procs:
                p.kill()


def cpu_share(node: int, nodes: int) -> Callable[[], None]:
    """A ``preexec_fn`` that runs emulated node ``node`` of ``nodes`` on its own share of this
    process's CPUs (at least one; round robin when there are more nodes than CPUs), as a machine of
    its own would.

    A launcher gives each of its ranks its CPUs divided by its local ranks as torch threads
    (``runner.launch.default_threads``), and the number of threads decides how torch splits a sum
    (last-bit differences). Nodes that share this machine's CPUs so give their ranks the threads
    that ``retexo train`` gives the same ranks on this machine, and they train the same bits.
    """
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // nodes)
    start = node * share % len(cpus)
    mine = set(cpus[start:start + share])
    return lambda: os.sched_setaffinity(0, mine)


def command_line(process: psutil.Process) -> str:
    """``process``'s command line, or "" once it has exited (a zombie or gone): a child listed by
    ``children()`` may exit before it is read, the more often the busier the machine."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # ZombieProcess included
        return ""
