"""A temporary Prefect API server whose first ``/health`` answer takes longer than Prefect's 5 s
still starts (``cli.prefect_runtime.start_temporary_server``), and one that never answers still
ends in Prefect's ``RuntimeError``, which ``retexo run`` reports in one line.

The slow answer is made, not hoped for: the server's process is stopped (SIGSTOP) as soon as it
exists, before it can bind its port, and a socket of the test's own holds that port and never
answers. Prefect's first health check then connects to that socket and times out. Once it has
given up (the socket sees it close), the test closes its socket and lets the server run on
(SIGCONT): it binds the port and answers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from cli.prefect_runtime import start_temporary_server

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WAIT_S = 60  # bound on each wait of the test's own; Prefect's read timeout is 5 s


def silent_listener() -> socket.socket:
    """A socket listening on a free port of 127.0.0.1 that accepts connections and never answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def hold_first_health_check(server: SubprocessASGIServer, listener: socket.socket, release: bool) -> threading.Thread:
    """A thread that stops ``server``'s process as soon as it exists, waits for the first client
    of ``listener`` (Prefect's health check) to give up and close its connection, then closes
    ``listener`` and, if ``release``, lets the server's process run on."""

    def hold() -> None:
        deadline = time.monotonic() + WAIT_S
        while server.server_process is None and time.monotonic() < deadline:
            time.sleep(0.001)
        process = server.server_process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)
        listener.settimeout(WAIT_S)
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(WAIT_S)
            while connection.recv(4096):  # the request; then b"" once the client has given up
                pass
        listener.close()
        if release:
            os.kill(process.pid, signal.SIGCONT)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


@contextmanager
def temporary_server_on(port: int, tmp_path: Path) -> Iterator[SubprocessASGIServer]:
    """Prefect's temporary server object for ``port`` over a database in ``tmp_path``; at the end
    its process is let run (SIGCONT) and stopped by Prefect's ``stop``, which forgets the object."""
    import prefect.settings
    from prefect.server.api.server import SubprocessASGIServer

    url = f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"
    with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL: url}):
        server = SubprocessASGIServer(port=port)
        try:
            yield server
        finally:
            if server.server_process is not None and server.server_process.poll() is None:
                os.kill(server.server_process.pid, signal.SIGCONT)
            server.stop()


def test_a_server_slower_than_prefects_health_check_is_waited_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    listener = silent_listener()
    port = listener.getsockname()[1]
    with temporary_server_on(port, tmp_path) as server:
        holder = hold_first_health_check(server, listener, release=True)
        with caplog.at_level(logging.INFO, logger="cli.prefect_runtime"):
            start_temporary_server(server, timeout_s=120)
        holder.join(WAIT_S)
        assert "is slow to answer" in caplog.text  # Prefect's own start raised httpx.TimeoutException
        assert server.running and server.port == port
        assert httpx.get(f"{server.api_url}/health", timeout=WAIT_S).json() is True


def test_a_server_that_never_answers_ends_in_prefects_runtime_error(tmp_path: Path) -> None:
    listener = silent_listener()
    port = listener.getsockname()[1]
    with temporary_server_on(port, tmp_path) as server:
        holder = hold_first_health_check(server, listener, release=False)
        with pytest.raises(RuntimeError, match="ephemeral Prefect API server: it did not answer"):
            start_temporary_server(server, timeout_s=8)
        holder.join(WAIT_S)
        assert not server.running
