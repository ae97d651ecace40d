"""Prefect API calls that only report (artifacts), made best-effort: the work never waits on them.

The store is the record of the pipeline's work; artifacts only show it in Prefect's UI. ``report``
makes such a call with no retries and a ``REPORT_TIMEOUT_S`` request timeout. When the API cannot
be reached (a network error or a timeout, not an error answer from a live server) this process
goes into *API lost* mode (``lose_api``), once:

- every later ``report`` is skipped at once;
- every other Prefect client call of this process fails fast too (no retries, the short timeout),
  so that the flow engine's own calls (the flow run's final state) fail within seconds instead
  of retrying for a minute each;
- run logs are no longer sent to the API, and Prefect's background services (events, logs) stop
  printing a warning per item they cannot send: the command says once that the API was lost
  (``cli.prefect_runtime.run_flow_here``).

Training and finalisation go on from the store either way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 5.0
T = TypeVar("T")

# Prefect loggers that report, item by item, what could not be sent to a lost API (the services'
# own failures are logged by ``prefect._internal.concurrency``, silenced by PREFECT_LOGGING_INTERNAL_LEVEL)
NOISY_LOGGERS = ("prefect.events.clients", "EventsWorker", "APILogWorker")

_lost: BaseException | None = None
_lost_lock = threading.Lock()


def api_lost() -> BaseException | None:
    """The error that showed this process the Prefect API was lost, or None while it is not."""
    return _lost


def is_unreachable(exc: BaseException) -> bool:
    """A network error or timeout on the way to the API (not an error answer of a live server)."""
    return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))


class _ApiTraffic(logging.Filter):
    """Drops the records of Prefect's own failures to reach the API (the command reports it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and is_unreachable(error))


def lose_api(exc: BaseException) -> None:
    """Enter API lost mode (see the module docstring); a no-op after the first call."""
    global _lost
    from prefect.context import refresh_global_settings_context
    from prefect.events.clients import NullEventsClient
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import set_api_log_sink

    with _lost_lock:
        if _lost is not None:
            return
        _lost = exc
        log.info("the Prefect API is lost (%s): reports to it stop; the work goes on from the store", exc)
        os.environ.update(PREFECT_CLIENT_MAX_RETRIES="0", PREFECT_API_REQUEST_TIMEOUT=str(REPORT_TIMEOUT_S),
                          PREFECT_LOGGING_TO_API_ENABLED="false", PREFECT_LOGGING_INTERNAL_LEVEL="CRITICAL")
        refresh_global_settings_context()
        set_api_log_sink(lambda record: None)
        EventsWorker.set_client_override(NullEventsClient)  # task run events from now on are dropped
        logging.raiseExceptions = False  # the log sender writes its failures to stderr unless this is off
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        for name in ("prefect.flow_runs", "prefect.task_runs"):
            logging.getLogger(name).addFilter(_ApiTraffic())


def report(call: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``call(*args, **kwargs)`` (a Prefect client call that only reports), or None when it could
    not be made: skipped in API lost mode; an unreachable API starts that mode; an error answer
    is a warning."""
    if _lost is not None:
        return None
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    try:
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_REQUEST_TIMEOUT: REPORT_TIMEOUT_S}):
            return call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  (a report never fails the work it reports on)
        if is_unreachable(exc):
            lose_api(exc)
        else:
            log.warning("could not report to the Prefect API (%s: %s); the work goes on", type(exc).__name__, exc)
        return None
