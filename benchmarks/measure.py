"""Running a command and measuring it as a whole: wall time and the peak memory of its process tree.

``run_measured`` starts a command, samples the resident set size of the command and every process
it started (workers included) every ``interval`` seconds with psutil, and returns the wall time,
the peak of the tree's summed RSS, the peak RSS of the largest single process, and the samples, so
that a caller can attribute memory to the phases it can date (e.g. the layers, from their
manifests' modification times).
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class Measured:
    seconds: float
    peak_tree_bytes: int  # max over samples of the summed RSS of the whole process tree
    peak_process_bytes: int  # max over samples and processes of one process's RSS
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds since start, tree, largest)
    stdout: str = ""

    def peak_between(self, start: float, end: float) -> tuple[int, int]:
        """(tree, largest process) peak RSS of the samples taken between ``start`` and ``end`` seconds."""
        inside = [(tree, one) for t, tree, one in self.samples if start <= t <= end] or [(0, 0)]
        return max(t for t, _ in inside), max(o for _, o in inside)


def tree_rss(root: psutil.Process) -> tuple[int, int]:
    """(summed RSS, largest RSS) of ``root`` and all its descendants, in bytes."""
    sizes = []
    for process in [root, *root.children(recursive=True)]:
        try:
            sizes.append(process.memory_info().rss)
        except psutil.Error:
            continue
    return sum(sizes), max(sizes, default=0)


def run_measured(command: list[str], cwd: Path, env: dict[str, str], interval: float = 0.2) -> Measured:
    """Run ``command`` to completion (raising on a non-zero exit) while sampling its process tree."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, stdin=subprocess.DEVNULL)
    root = psutil.Process(process.pid)
    samples: list[tuple[float, int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                tree, largest = tree_rss(root)
            except psutil.Error:
                break
            samples.append((time.perf_counter() - started, tree, largest))
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    done.set()
    sampler.join()
    seconds = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{output[-3000:]}")
    return Measured(seconds, max((s[1] for s in samples), default=0), max((s[2] for s in samples), default=0),
                    samples, output)
