"""What a flow run started in a command's own process (``cli.prefect_runtime.run_flow_here``)
shares with that process.

- The process tag: every flow run started there is tagged ``retexo-process:<host>:<pid>:<start
  time>`` (``PROCESS_TAG``), so that flow runs left ``RUNNING`` by a dead process can be told
  apart; the task runs of the flow leave it off (``untagged_tasks``).
- What the flow has completed, in words (``note_outcome``): the command says it if the Prefect
  API is lost before the flow run's final state is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

PROCESS_TAG = "retexo-process"

_outcome: str | None = None


@contextmanager
def untagged_tasks() -> Iterator[None]:
    """Inside a flow run: the task runs it starts do not carry the process tag, which only the
    flow run needs. (Prefect asks the API for a tagged task run's concurrency slots before it
    starts, which would fail every task once the API is lost.)"""
    from prefect.context import TagsContext

    current = TagsContext.get().current_tags
    with TagsContext(current_tags={t for t in current if not t.startswith(f"{PROCESS_TAG}:")}):
        yield


def note_outcome(text: str) -> None:
    """What the flow running in this process has completed, in words."""
    global _outcome
    _outcome = text


def noted_outcome() -> str | None:
    """The last ``note_outcome`` since ``forget_outcome``; None when the flow noted nothing."""
    return _outcome


def forget_outcome() -> None:
    """Before a flow starts: nothing completed yet."""
    global _outcome
    _outcome = None
