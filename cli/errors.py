"""How a failed command ends: one line on stderr and an exit code, never a traceback, for the
failures a user can act on (a ``RetexoError``, an invalid option, an operating-system error such
as a full disk, running out of memory), and a quiet stop when the reader of stdout went away."""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import ValidationError
from rich.markup import escape

from cli.console import err
from cli.shared_options import OPENED_STORES
from graphstore.errors import RetexoError, describe_validation_error
from graphstore.units import human_bytes


def fail(line: str) -> None:
    """``error: <line>`` on stderr (``line`` is printed as it is: paths and values may hold [brackets])."""
    err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)


@contextmanager
def failures_in_one_line() -> Iterator[None]:
    """Inside: a failure a user can act on ends the command with one line and exit code 2; a
    closed stdout (``| head``) ends it quietly with exit code 1."""
    try:
        yield
    except RetexoError as exc:
        fail(str(exc))
        raise SystemExit(2) from None
    except ValidationError as exc:
        fail(describe_validation_error(exc, "invalid option"))
        raise SystemExit(2) from None
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise SystemExit(1) from None
    except OSError as exc:  # a full disk, a read-only or vanished file system, permissions
        fail(os_error_line(exc))
        raise SystemExit(2) from None
    except MemoryError as exc:  # more than the estimate foresaw, or a memory limit set on the process
        fail(f"out of memory ({str(exc) or 'no detail'}): nothing half-written is left in the store; free memory, "
             "or make the request smaller")
        raise SystemExit(2) from None


def os_error_line(exc: OSError) -> str:
    """One line for an operating-system error: what happened and where (the file it names; else the
    store the command opened, with the free space of its file system)."""
    what = os.strerror(exc.errno) if exc.errno else str(exc)
    said = f": {exc.strerror}" if exc.strerror and exc.strerror != what else ""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    if paths:
        return f"{what.lower()}: {' -> '.join(paths)}{said}"
    if not OPENED_STORES:
        return f"{what.lower()}{said}"
    root = OPENED_STORES[-1]
    try:
        where = f"the store {root} ({human_bytes(shutil.disk_usage(root).free)} free)"
    except OSError:
        where = f"the store {root}"
    if exc.errno == errno.ENOSPC:
        return f"no space left on device, writing to {where}: free some space, or use a store on another disk (--store)"
    return f"{what.lower()} in {where}{said}"
