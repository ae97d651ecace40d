"""Run several commands at once and wait for all of them (tests and benchmarks that start sites)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

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
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
