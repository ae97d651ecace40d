"""A spawned worker never outlives its launcher.

The kernel kills the worker when the launcher dies (``PR_SET_PDEATHSIG``), and a daemon thread
waits on the launcher's ``multiprocessing`` sentinel (it closes when the launcher process dies,
whichever of its threads started the worker) and ends the worker at once with ``os._exit``,
committing nothing. A layer is also never committed once the launcher is gone
(``ensure_launcher_alive``, called by ``runner.results.RunFolder.commit_layer`` just before the
commit). Recording the run ``interrupted`` and removing the temp folders is the launcher's
guard's job (``runner.descendant_guard``), once the workers are gone: a worker does neither.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import NoReturn

ORPHANED_EXIT = 3  # exit code of a worker that stopped because its launcher died


class LauncherWatch:
    """Ends a spawned worker as soon as its launcher process is gone (see the module docstring).

    Every worker asks the kernel for SIGKILL when the launcher dies (``PR_SET_PDEATHSIG``, Linux),
    which also ends a worker that is stopped or stuck without the GIL; it fires when the launcher
    *thread* that spawned the worker exits, which is safe here because ``run_workers`` starts and
    waits for its workers in one thread. A daemon thread waits on the launcher's sentinel as
    well (where PDEATHSIG is missing, or the launcher died before it was set).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.parent = mp.parent_process()

    def start(self) -> None:
        if self.parent is None:
            return
        die_with_parent_thread()
        threading.Thread(target=self._wait, name="retexo-launcher-watch", daemon=True).start()

    def _wait(self) -> None:
        self.parent.join()  # type: ignore[union-attr]  # returns when the launcher's end of the pipe closes
        self.launcher_gone()

    def check(self) -> None:
        if self.parent is not None and not self.parent.is_alive():
            self.launcher_gone()

    def launcher_gone(self) -> NoReturn:
        try:
            logging.getLogger("retexo.worker").error("rank %d: the launcher died; stopping", self.rank)
        finally:
            os._exit(ORPHANED_EXIT)


_WATCH: LauncherWatch | None = None  # set in spawned workers only


def watch_launcher(rank: int) -> None:
    """In a spawned worker process of rank ``rank``: start watching the launcher (first thing,
    before torch is imported)."""
    global _WATCH
    _WATCH = LauncherWatch(rank)
    _WATCH.start()


def ensure_launcher_alive() -> None:
    """In a spawned worker: stop here (``os._exit``, nothing committed) if the launcher is gone.
    A no-op anywhere else (ranks run as threads, other processes)."""
    if _WATCH is not None:
        _WATCH.check()


def die_with_parent_thread() -> None:
    """Ask the kernel to SIGKILL this process when the thread that spawned it exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watch thread alone then
