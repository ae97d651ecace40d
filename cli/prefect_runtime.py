"""Running a flow in this process (``retexo run``) robustly: a Prefect API that starts on a busy
machine, and flow runs that never stay ``RUNNING`` after their process died.

- Without ``PREFECT_API_URL`` Prefect starts a temporary (ephemeral) API server and waits 20 s
  for it by default; under CPU load that is too short. ``EPHEMERAL_STARTUP_TIMEOUT_S`` is used
  unless the user set ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``, and a server that
  still does not start is reported in one line that says what to do. Prefect's wait gives each
  ``/health`` request 5 s and fails on the first slower answer, which a busy machine's server can
  take: ``start_temporary_server`` waits for it instead, within the same limit.
- Every flow run started here is tagged with this process (``retexo-process:<host>:<pid>:<start
  time>``, ``flows.local_run``). Before a new flow runs, flow runs of this host still ``RUNNING``
  whose process is gone (killed with SIGKILL, or the machine lost power) are set to ``Crashed``.
  A run interrupted by SIGINT or SIGTERM is marked ``Crashed`` by Prefect's engine itself.
- An API lost while the flow runs (its server died) stops none of the flow's work: reports to it
  are best-effort (``tasks.best_effort``) and the work is recorded in the store. The flow run's
  final state can then not be recorded: one line says so and what the flow completed
  (``flows.local_run.note_outcome``; ``PrefectApiLost``, exit code 2), seconds after the work ends.
- The temporary API server is a child process that Prefect stops when this process exits; this
  process's ``runner.descendant_guard`` stops it (and any other descendant) when this process is
  killed. It starts with its libraries' log records below CRITICAL off (``quiet_temporary_server``):
  stopped at exit, its database pool could print a traceback after the command's last line.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psutil

from flows.local_run import PROCESS_TAG, forget_outcome, noted_outcome
from graphstore.errors import RetexoError
from runner.descendant_guard import guard_descendants
from tasks.best_effort import api_lost, is_unreachable

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer

log = logging.getLogger(__name__)

EPHEMERAL_STARTUP_TIMEOUT_S = 120
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
QUIET_SERVER_ENV = "PREFECT_LOGGING_ROOT_LEVEL"  # the root logger's level in Prefect's logging.yml


class PrefectUnavailable(RetexoError):
    """The Prefect API could not be reached or started."""


class PrefectApiLost(PrefectUnavailable):
    """The Prefect API went away while a flow ran here: the flow run's state was not recorded."""


def process_tag(pid: int | None = None) -> str:
    """``retexo-process:<host>:<pid>:<start time>`` of a process (this one by default); the start
    time tells a reused pid apart."""
    process = psutil.Process(pid)
    return f"{PROCESS_TAG}:{socket.gethostname()}:{process.pid}:{int(process.create_time())}"


def process_is_alive(tag: str) -> bool:
    """True when the process a tag names still runs (or runs on another host: not ours to judge)."""
    _, host, pid, started = tag.split(":")
    if host != socket.gethostname():
        return True
    try:
        return int(psutil.Process(int(pid)).create_time()) == int(started)
    except (psutil.NoSuchProcess, ValueError):
        return False


def mark_orphaned_flow_runs() -> list[str]:
    """Set to ``Crashed`` the ``RUNNING`` flow runs started by a ``retexo`` process of this host
    that no longer exists; returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    marked = []
    with get_client(sync_client=True) as client:
        running = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))))
        for run in running:
            tags = [t for t in run.tags or [] if t.startswith(f"{PROCESS_TAG}:")]
            if tags and not process_is_alive(tags[0]):
                pid = tags[0].split(":")[2]
                client.set_flow_run_state(run.id, Crashed(message=f"its process (pid {pid}) died while it ran"),
                                          force=True)
                marked.append(str(run.name))
    for name in marked:
        log.warning("flow run %s was left RUNNING by a process that died: marked Crashed", name)
    return marked


def prepare_environment() -> None:
    """Settings Prefect reads when it is imported: call before importing any flow."""
    os.environ.setdefault(STARTUP_TIMEOUT_ENV, str(EPHEMERAL_STARTUP_TIMEOUT_S))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no banner, no calls out


def api_location() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "the temporary server"


def run_flow_here(flow: Callable[..., Any], *args: Any) -> Any:
    """Run ``flow(*args)`` in this process and return its final state (``return_state=True``).

    Orphaned flow runs are marked first; a Prefect API that cannot be started or reached is a
    ``PrefectUnavailable`` with one line of advice instead of a traceback. An API lost while the
    flow runs does not stop its work (``tasks.best_effort``), but the flow run's state can then not
    be recorded: a ``PrefectApiLost`` says so, and what the flow completed
    (``flows.local_run.note_outcome``).
    """
    from prefect import tags

    guard_descendants()
    forget_outcome()
    reach_api(mark_orphaned_flow_runs)
    try:
        with tags(process_tag()):
            return flow(*args, return_state=True)
    except Exception as exc:
        if api_lost() is None and not is_unreachable(exc):
            raise
        raise PrefectApiLost(api_lost_message(api_lost() or exc, exc)) from None


def api_lost_message(cause: BaseException, raised: BaseException) -> str:
    """One line: the API was lost (``cause``), and what the flow completed or why it failed (the
    error that the failed state update of the flow run hides in ``raised``'s context)."""
    done = noted_outcome()
    if done is None:
        failure: BaseException | None = raised
        while failure is not None and is_unreachable(failure):
            failure = failure.__context__
        why = "" if failure is None else f" ({type(failure).__name__}: {' '.join(str(failure).split())[:300]})"
        done = f"the flow did not complete{why}; what it committed stays in the store, and running it again resumes there"
    return (f"the Prefect API at {api_location()} was lost while the flow ran ({str(cause) or type(cause).__name__}), "
            f"so the flow run's state was not recorded; {done}")


@contextmanager
def quiet_temporary_server() -> Iterator[None]:
    """While the temporary API server starts, its process is given ``QUIET_SERVER_ENV``, so that it
    prints no library's log record below CRITICAL: when Prefect stops it at exit, its database pool
    may log a cancelled connection reset as a traceback on this command's stderr. Its own loggers
    (``prefect.server``, uvicorn) keep their levels, and this process's logging is set up already."""
    if os.environ.get("PREFECT_API_URL") or QUIET_SERVER_ENV in os.environ:
        yield
        return
    os.environ[QUIET_SERVER_ENV] = "CRITICAL"
    try:
        yield
    finally:
        os.environ.pop(QUIET_SERVER_ENV, None)


def start_temporary_server(server: SubprocessASGIServer, timeout_s: float,
                           start: Callable[[SubprocessASGIServer, int], None] | None = None) -> None:
    """``server.start(timeout_s)`` (or ``start(server, timeout_s)``, e.g. Prefect's own method where
    a test harness replaces it), patient with a server that is slow to answer
    (``wait_for_slow_server``)."""
    import httpx

    try:
        if start is None:
            server.start(timeout=int(timeout_s))
        else:
            start(server, int(timeout_s))
    except httpx.TimeoutException:
        wait_for_slow_server(server, timeout_s)


def wait_for_slow_server(server: SubprocessASGIServer, timeout_s: float) -> None:
    """Wait for a temporary server whose ``start`` raised ``httpx.TimeoutException``.

    Prefect's start polls ``/health`` with httpx's default 5 s read timeout and raises on the
    first slower answer, which a server that has bound its port on a busy machine can take. Here
    its ``/health`` is polled again for up to ``timeout_s`` seconds, each request allowed the rest
    of that time; a server that exits or still does not answer raises the ``RuntimeError`` that
    Prefect's start raises ("... ephemeral Prefect API server ...")."""
    import httpx

    log.info("the temporary Prefect API server at %s is slow to answer; waiting up to %s s more",
             server.api_url, timeout_s)
    process = server.server_process
    deadline = time.monotonic() + timeout_s
    while process is not None and process.poll() is None and (left := deadline - time.monotonic()) > 0:
        try:
            if httpx.get(f"{server.api_url}/health", timeout=left).status_code == 200:
                server.running = True  # what Prefect's start sets once the server answers
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    why = "exited" if process is None or process.poll() is not None else "did not answer"
    raise RuntimeError(f"Timed out while attempting to connect to ephemeral Prefect API server: it {why}.")


def reach_api(first_call: Callable[[], Any]) -> None:
    """``first_call()``, the first use of the Prefect API here, after starting the temporary
    server (``start_temporary_server``) when no PREFECT_API_URL is set; one line of advice when the
    API cannot be started or reached."""
    import httpx
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    try:
        with quiet_temporary_server():
            if not PREFECT_API_URL.value():
                # the instance Prefect's clients start (and find started) when they have no API URL
                start_temporary_server(SubprocessASGIServer(), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
            first_call()
    except RuntimeError as exc:
        if "ephemeral Prefect API server" not in str(exc):
            raise
        timeout = os.environ.get(STARTUP_TIMEOUT_ENV, "20")
        raise PrefectUnavailable(
            f"the temporary Prefect API server did not start within {timeout} s (is the machine very busy?): "
            f"set {STARTUP_TIMEOUT_ENV} higher, or start a server with `prefect server start` and point "
            "PREFECT_API_URL at it") from None
    except httpx.ConnectError as exc:
        raise PrefectUnavailable(
            f"cannot reach the Prefect API at {os.environ.get('PREFECT_API_URL', '(ephemeral)')} ({exc}): start it "
            "(`prefect server start`) or unset PREFECT_API_URL to use a temporary one") from None
