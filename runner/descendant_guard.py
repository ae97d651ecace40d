"""A watchdog process that cleans up after a command that dies, however it dies (SIGKILL included).

A process killed with SIGKILL runs no clean-up of its own. The first call of ``guard_run`` or
``guard_descendants`` in a process starts this module as a small child process (in its own
session, so that Ctrl-C does not stop it first) that holds the read end of a pipe whose write end
only the command holds: the pipe closes exactly when the command ends (the guard also looks
every ``POLL_S`` seconds whether the command still runs). Over the pipe the command
tells the guard, one JSON line per message:

- ``{"hold": [store, run]}`` / ``{"release": [store, run]}`` (``guard_run``, around the time
  ``runner.lifecycle.run_training`` holds a run): when the command dies holding a run, the guard
  waits until no process holds the run any more (the command and the worker processes of its
  launch, which exit at once when their launcher dies: ``runner.launcher_watch``), then
  records ``interrupted`` if the run's last event is ``started`` and removes the temp folders of
  the run (``graphstore.maintenance.finish_abandoned_run``);
- ``{"stop": true}`` (``guard_descendants``, ``retexo run``): the guard also notes the command's
  descendants every ``POLL_S`` seconds (Prefect's temporary API server is a child the command did
  not start itself); when the command dies it asks those still running to stop (SIGTERM), and
  kills them (SIGKILL) after ``GRACE_S`` seconds.

A command that exits normally has released its runs and stopped its children already, and the
guard finds nothing to do.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from graphstore.layout import Store

log = logging.getLogger(__name__)

POLL_S = 0.5
GRACE_S = 3.0
WORKERS_GONE_S = 10.0  # how long the guard waits for a dead command's workers to release its runs


class _Client:
    """This process's end of its guard: the pipe's write end (not inheritable)."""

    def __init__(self) -> None:
        read_end, self.write_end = os.pipe()
        self.owner = os.getpid()
        self.process = subprocess.Popen([sys.executable, "-m", "runner.descendant_guard", str(self.owner)],
                                        stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(read_end)

    def send(self, message: dict[str, object]) -> None:
        os.write(self.write_end, (json.dumps(message) + "\n").encode())  # one write under PIPE_BUF: atomic


_CLIENT: _Client | None = None
_CLIENT_LOCK = threading.Lock()


def tell_guard(message: dict[str, object]) -> None:
    """Send ``message`` to this process's guard, starting the guard first if needed (also in a
    forked child, whose parent's guard watches the parent). A guard that cannot be started or
    reached is a warning: the next run and ``retexo store gc`` still mark an abandoned run."""
    global _CLIENT
    with _CLIENT_LOCK:
        try:
            if _CLIENT is None or _CLIENT.owner != os.getpid():
                _CLIENT = _Client()
            _CLIENT.send(message)
        except OSError as exc:
            log.warning("the clean-up guard of this process is not running (%s): a run it trains is marked "
                        "interrupted only by the next run or `retexo store gc` if this process is killed", exc)


def guard_descendants() -> None:
    """From now on, stop every descendant of this process when it dies (``retexo run``)."""
    tell_guard({"stop": True})


@contextmanager
def guard_run(store: Store, run: str) -> Iterator[None]:
    """While inside: if this process dies, its guard finishes ``run`` (see the module docstring)."""
    key = [str(store.root), run]
    tell_guard({"hold": key})
    try:
        yield
    finally:
        tell_guard({"release": key})


class _Guard:
    """The guard's state: the runs the command holds, and whether (and which) descendants to stop."""

    def __init__(self, pid: int):
        self.pid = pid
        self.held: Counter[tuple[str, str]] = Counter()
        self.stop = False
        self.known: dict[int, psutil.Process] = {}
        self.pending = b""

    def take(self, data: bytes) -> None:
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "hold" in message:
                import graphstore.maintenance  # noqa: F401  (imported now, ready when it is needed)

                self.held[tuple(message["hold"])] += 1  # type: ignore[index]
            elif "release" in message:
                self.held[tuple(message["release"])] -= 1  # type: ignore[index]
            elif message.get("stop"):
                self.stop = True

    def note_descendants(self, command: psutil.Process) -> None:
        me = os.getpid()
        self.known.update({p.pid: p for p in command.children(recursive=True) if p.pid != me})

    def finish(self) -> None:
        """The command is gone: stop its descendants and finish the runs it held."""
        left = [p for p in self.known.values() if p.is_running()]  # is_running: not a new process with a reused pid
        for process in left:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        for (root, run), count in self.held.items():
            if count > 0:
                self.finish_run(Store(Path(root)), run)
        _, alive = psutil.wait_procs(left, timeout=GRACE_S)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def finish_run(self, store: Store, run: str) -> None:
        from graphstore.maintenance import finish_abandoned_run

        try:
            finish_abandoned_run(store, run, f"the launcher (pid {self.pid}) died; workers stopped", WORKERS_GONE_S)
        except Exception as exc:  # noqa: BLE001  (one line on the terminal the command had, then the next run)
            print(f"retexo: run {run} could not be marked interrupted after its launcher (pid {self.pid}) died: "
                  f"{exc}; the next run of it or `retexo store gc` will", file=sys.stderr)


def guard(pid: int) -> None:
    """Follow the command's messages until stdin closes, then clean up after it (also when the
    command died before this process even started: its messages are still in the pipe)."""
    try:  # the command is this process's parent while it lives (else its pid may be another's by now)
        command: psutil.Process | None = psutil.Process(pid) if os.getppid() == pid else None
    except psutil.NoSuchProcess:
        command = None
    state = _Guard(pid)
    stdin = sys.stdin.fileno()
    while True:
        try:
            if state.stop and command is not None:
                state.note_descendants(command)
            gone = command is None or not command.is_running()
        except psutil.NoSuchProcess:
            gone = True
        ready, _, _ = select.select([stdin], [], [], 0 if gone else POLL_S)
        if not ready and gone:
            break  # the command is gone and said everything (a forked child may keep the pipe open)
        if ready:
            data = os.read(stdin, 65536)
            if not data:
                break  # end of file: the command is gone
            state.take(data)
    state.finish()


if __name__ == "__main__":
    guard(int(sys.argv[1]))
