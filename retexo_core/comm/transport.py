"""Raw movement of uint8 payloads between the K ranks of a run, behind the communicator.

The communicator encodes, counts and logs; a transport only moves bytes. Two implementations:

* ``GlooTransport``: one rank per process over the default torch.distributed (gloo) group
  (``irecv`` from every peer posted before any ``isend``, monitored barrier), plus the re-formation of the group with the
  survivors that tolerant strategies need (``published_members`` / ``reform``).
* ``ThreadTransport``: one rank per thread of a single process, all sharing a ``ThreadHub``. Every
  ordered pair (src, dst) has a FIFO mailbox; since every rank issues the same sequence of
  operations (SPMD), the n-th message from src to dst is the one dst's n-th operation expects.
  Payloads are copied when sent, so ranks never share memory one of them later writes (the
  all-reduce, whose protocol guarantees that, hands its payloads over uncopied).

Every wait honours a timeout and names the rank it waited for; ``ThreadHub.abort`` wakes every
waiting thread at once (used when a rank's thread dies, so its peers need not wait out the timeout).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class Transport(Protocol):
    """Moves uint8 payloads between the ranks of the current group (ranks are group ranks)."""

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int], timeout: timedelta) -> list[torch.Tensor]:
        """``send[j]``: (n_j,) uint8 payload for rank j (own slot empty); returns ``recv[j]``: the
        (recv_sizes[j],) uint8 payload from rank j, in bytes."""
        ...

    def barrier(self, timeout: timedelta) -> None:
        """Wait until every rank arrived; a missing rank is named in the error. Carries no payload."""
        ...


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


# ------------------------------------------------------------------------------------------- gloo
class GlooTransport:
    """The default torch.distributed process group (gloo), one rank per process.

    Attributes:
        rendezvous: the launcher's key-value store (the group formed through ``PrefixStore("gen0",
            rendezvous)``), needed to re-form the group after a peer died; None when not launched so.
    """

    def __init__(self, rendezvous: dist.Store | None = None) -> None:
        self.rendezvous = rendezvous

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int], timeout: timedelta) -> list[torch.Tensor]:
        """Every receive is posted before any send (``irecv`` from each peer, then ``isend`` to
        each), then all are waited for, each within ``timeout``. gloo's own alltoallv posts a
        send to rank r+i before the receive from rank r-i, and a send starts only when its
        receiver's "ready" message arrived, on the same TCP connection as the receiver's own
        data: over a slow link one direction of a pair then waits for the other (measured on
        4 tbf-shaped sites: 1.3-1.6x bytes / bandwidth per exchange, 1.1x with receives
        first). Empty payloads are neither sent nor received."""
        rank = dist.get_rank()
        received = [torch.empty(n, dtype=torch.uint8) if j != rank else _empty() for j, n in enumerate(recv_sizes)]
        pending = [dist.irecv(received[j], src=j) for j, n in enumerate(recv_sizes) if j != rank and n]
        pending += [dist.isend(p.contiguous(), dst=j) for j, p in enumerate(send) if j != rank and p.numel()]
        for request in pending:
            request.wait(timeout)
        return received

    def barrier(self, timeout: timedelta) -> None:
        """gloo's monitored barrier: rank 0 names the first rank that did not arrive."""
        dist.monitored_barrier(timeout=timeout)

    def published_members(self, generation: int, timeout: timedelta) -> list[int]:
        """Wait (up to ``timeout``) for the launcher to publish key ``members/<generation>`` and
        return the surviving partition ids. Raises RuntimeError if nothing is published in time."""
        if self.rendezvous is None:
            raise RuntimeError("no rendezvous store")
        key = f"members/{generation}"
        self.rendezvous.wait([key], timeout)
        return [int(m) for m in self.rendezvous.get(key).decode().split(",")]

    def reform(self, generation: int, rank: int, world: int, timeout: timedelta) -> None:
        """Replace the default process group by a new one of ``world`` ranks, formed through
        ``PrefixStore(f"gen{generation}", rendezvous)``, in which this process is ``rank``."""
        if self.rendezvous is None:
            raise RuntimeError("no rendezvous store")
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}", self.rendezvous),
                                rank=rank, world_size=world, timeout=timeout)


# ---------------------------------------------------------------------------------------- threads
@dataclass(frozen=True)
class _Message:
    op: str  # the operation that sent it: "all_to_all" or "barrier"
    payload: torch.Tensor  # (n,) uint8: a copy of what was sent (or, sent uncopied, the sender's tensor)


class ThreadHub:
    """Mailboxes shared by the ``world`` threads of one process that act as ranks 0..world-1.

    One FIFO queue per ordered pair (src, dst), all guarded by one lock; a message wakes only its
    receiver (one condition per receiving rank), not every waiting rank.
    """

    def __init__(self, world: int) -> None:
        if world < 1:
            raise ValueError(f"a hub needs at least one rank, got world={world}")
        self.world = world
        self._lock = threading.Lock()
        self._arrived = [threading.Condition(self._lock) for _ in range(world)]  # one per receiving rank
        self._boxes: dict[tuple[int, int], deque[_Message]] = {
            (src, dst): deque() for src in range(world) for dst in range(world)
        }
        self._aborted: str | None = None

    def transport(self, rank: int) -> ThreadTransport:
        """The transport the thread acting as ``rank`` uses."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside 0..{self.world - 1}")
        return ThreadTransport(self, rank)

    @property
    def aborted(self) -> str | None:
        """The reason given to ``abort``, or None while the hub works."""
        return self._aborted

    def abort(self, reason: str) -> None:
        """Wake every waiting rank with ``RuntimeError(reason)``; every later operation fails at
        once with the same error. The first reason given is kept."""
        with self._lock:
            if self._aborted is None:
                self._aborted = reason
            for arrived in self._arrived:
                arrived.notify_all()

    def put(self, src: int, dst: int, op: str, payload: torch.Tensor, copy: bool = True) -> None:
        """Queue ``payload`` ((n,) uint8) from ``src`` for ``dst``: a copy of it, or with ``copy``
        False the tensor itself, which the sender must not write before ``dst`` has read it;
        never blocks."""
        if payload.dtype != torch.uint8:
            raise ValueError(f"rank {src}: payloads are uint8, got {payload.dtype}")
        payload = payload.detach().reshape(-1)
        message = _Message(op, payload.clone() if copy else payload)
        with self._lock:
            if self._aborted is not None:
                raise RuntimeError(self._aborted)
            self._boxes[(src, dst)].append(message)
            self._arrived[dst].notify()

    def take(self, dst: int, sources: list[int], op: str, sizes: list[int], timeout: timedelta) -> list[torch.Tensor]:
        """The next message from each of ``sources`` to ``dst`` (one per source, in that order),
        each checked to come from operation ``op`` and to be ``sizes[i]`` bytes.

        Waits up to ``timeout`` for all of them; raises RuntimeError naming the ranks still missing.
        """
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds
        with self._lock:
            while True:
                if self._aborted is not None:
                    raise RuntimeError(self._aborted)
                missing = [src for src in sources if not self._boxes[(src, dst)]]
                if not missing:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = ", ".join(map(str, missing))
                    raise RuntimeError(f"rank {dst} waited {seconds:g} s for rank{'s' if len(missing) > 1 else ''} "
                                       f"{names} ({op})")
                self._arrived[dst].wait(remaining)
            messages = [self._boxes[(src, dst)].popleft() for src in sources]
        for src, size, message in zip(sources, sizes, messages):
            if message.op != op:
                raise RuntimeError(f"rank {dst} expected a {op} message from rank {src} but got a {message.op} "
                                   f"message (the ranks issued different operations)")
            if message.payload.numel() != size:
                raise RuntimeError(f"rank {dst} expected {size} B from rank {src} ({op}) but "
                                   f"{message.payload.numel()} B arrived")
        return [m.payload for m in messages]


class ThreadTransport:
    """Rank ``rank`` of a ``ThreadHub``; call it only from that rank's thread.

    Unlike gloo, empty messages are exchanged too, so every operation pairs up message for message
    and a disagreement about sizes is detected even when one side expects nothing.
    """

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int], timeout: timedelta,
                   copy: bool = True) -> list[torch.Tensor]:
        """``Transport.all_to_all``; with ``copy`` False the payloads are handed over uncopied, for
        a caller that does not write them before every receiver has read them (``put``)."""
        world = self.hub.world
        if len(send) != world or len(recv_sizes) != world:
            raise ValueError(f"rank {self.rank}: all_to_all needs {world} payloads and sizes, "
                             f"got {len(send)} and {len(recv_sizes)}")
        if send[self.rank].numel() != recv_sizes[self.rank]:
            raise RuntimeError(f"rank {self.rank} expected {recv_sizes[self.rank]} B from itself but "
                               f"sent itself {send[self.rank].numel()} B")
        peers = [j for j in range(world) if j != self.rank]
        for j in peers:
            self.hub.put(self.rank, j, "all_to_all", send[j], copy)
        received = self.hub.take(self.rank, peers, "all_to_all", [recv_sizes[j] for j in peers], timeout)
        out = dict(zip(peers, received))
        out[self.rank] = send[self.rank].detach().reshape(-1).clone()
        return [out[j] for j in range(world)]

    def barrier(self, timeout: timedelta) -> None:
        peers = [j for j in range(self.hub.world) if j != self.rank]
        for j in peers:
            self.hub.put(self.rank, j, "barrier", _empty())
        self.hub.take(self.rank, peers, "barrier", [0] * len(peers), timeout)
