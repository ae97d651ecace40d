"""A watchdog process that stops a command's descendants when the command dies, however it dies.

A process killed with SIGKILL runs no clean-up, and children it did not start itself (Prefect's
temporary API server behind ``retexo run``) would be left running. ``start_guard()`` starts
this module as a small child process holding the read end of a pipe whose write end only the
command holds. The guard notes the command's descendants every ``POLL_S`` seconds; when the pipe
closes (the command exited or was killed) it asks those still running to stop (SIGTERM), and
kills them (SIGKILL) after ``GRACE_S`` seconds. A command that exits normally has stopped its
children already, and the guard finds nothing to do.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

import psutil

POLL_S = 0.5
GRACE_S = 3.0


def start_guard() -> subprocess.Popen[bytes]:
    """Start the guard of this process (in its own session, so that Ctrl-C does not stop it first).

    The pipe's write end is never closed here and is not inheritable, so it closes exactly when
    this process ends."""
    read_end, write_end = os.pipe()
    guard = subprocess.Popen([sys.executable, "-m", "runner.descendant_guard", str(os.getpid())], stdin=read_end,
                             stdout=subprocess.DEVNULL, start_new_session=True)
    os.close(read_end)
    return guard


def guard(pid: int) -> None:
    """Watch ``pid``'s descendants until stdin closes, then stop those still running."""
    try:
        command = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    while True:
        try:
            known.update({p.pid: p for p in command.children(recursive=True) if p.pid != me})
        except psutil.NoSuchProcess:
            break
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # end of file: the command is gone
    left = [p for p in known.values() if p.is_running()]  # is_running: not a new process with a reused pid
    for process in left:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    guard(int(sys.argv[1]))
