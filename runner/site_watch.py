"""Heartbeats between the sites of a run, so that a site that dies or freezes is named at every other.

Each site's rank counts a heartbeat in the run's rendezvous store (hosted by site 0) every
``BEAT_S`` seconds from a daemon thread, over its own connection with a short timeout, and reads
the others' counts. A peer whose count has not moved for a while is silent:

- when a collective fails (gloo says only "Connection closed by peer [address]:port"),
  :meth:`SiteWatch.lost` waits a few beats and names the silent sites (``SiteLost``);
- when a peer stays silent for ``hang_timeout_s`` while this site waits (its own process used
  almost no CPU time over that while, as in a blocked collective; a frozen peer would keep it there
  until ``--timeout``), the watch ends this process with that line in its error file, which its
  launcher reports. A site busy with its own work (writing its results after site 0 has left) is
  not stopped.

A site that finished marks itself done and is never blamed. The store going away means site 0 went
away: it hosts the store. The beats are rendezvous traffic, not training traffic: they are not in
the communication log.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

BEAT_S = 1.0  # seconds between two heartbeats of a site
STORE_TIMEOUT_S = 5.0  # a heartbeat that takes longer counts as a silent store (site 0)


class SiteLost(RuntimeError):
    """Another site of the run died, froze, or lost its link."""


def site_name(rank: int) -> str:
    return f"site {rank} (rank {rank}{', which hosts the rendezvous' if rank == 0 else ''})"


class SiteWatch:
    """Heartbeats of site ``rank`` of ``world`` through ``connect()`` (a new store client), and the
    others' silence. ``on_frozen(line)`` runs when a peer has been silent for ``hang_timeout_s``."""

    def __init__(self, connect: Callable[[timedelta], object], rank: int, world: int, hang_timeout_s: float,
                 on_frozen: Callable[[str], None]):
        self.rank, self.world, self.hang_timeout_s, self.on_frozen = rank, world, hang_timeout_s, on_frozen
        self.store = connect(timedelta(seconds=STORE_TIMEOUT_S))
        now = time.monotonic()
        self.count = {j: -1 for j in range(world) if j != rank}
        self.heard = {j: now for j in self.count}  # when each peer's count last moved (monotonic s)
        self.done: set[int] = set()
        self.store_heard = now
        self.cpu: list[tuple[float, float]] = [(now, time.process_time())]  # (monotonic s, this process's CPU s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="retexo-site-watch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(BEAT_S):
            self.beat()
            silent = self.silent(self.hang_timeout_s)
            if silent and self.waiting() and not self.stop.is_set():
                self.on_frozen(f"{silent}: no heartbeat for {self.hang_timeout_s:g} s (frozen, or its machine "
                               f"or link is down); site {self.rank} stops instead of waiting for --timeout")
                return

    def beat(self) -> None:
        """Count this site's heartbeat and read the others' (one store round trip each)."""
        try:
            self.store.add(f"retexo/beat/{self.rank}", 1)  # type: ignore[attr-defined]
            for j in self.count:
                if j in self.done:
                    continue
                count = self.store.add(f"retexo/beat/{j}", 0)  # type: ignore[attr-defined]
                if count != self.count[j]:
                    self.count[j], self.heard[j] = count, time.monotonic()
                if self.store.check([f"retexo/done/{j}"]):  # type: ignore[attr-defined]
                    self.done.add(j)
            self.store_heard = time.monotonic()
        except Exception:  # noqa: BLE001  (the store's host is gone or frozen: that is what we watch for)
            pass

    def waiting(self) -> bool:
        """Whether this process used under a tenth of the last ``hang_timeout_s`` as CPU time."""
        now = time.monotonic()
        self.cpu.append((now, time.process_time()))
        while len(self.cpu) > 2 and now - self.cpu[1][0] >= self.hang_timeout_s:
            self.cpu.pop(0)
        (then, used_then), (_, used_now) = self.cpu[0], self.cpu[-1]
        return now - then >= self.hang_timeout_s and used_now - used_then < 0.1 * (now - then)

    def silent(self, seconds: float) -> str | None:
        """The sites not heard from for ``seconds`` (site 0 when the store itself is silent), as
        words, or None."""
        now = time.monotonic()
        if now - self.store_heard >= seconds:
            return site_name(0)
        gone = [j for j, heard in self.heard.items() if j not in self.done and now - heard >= seconds]
        return ", ".join(site_name(j) for j in gone) or None

    def lost(self, failure: BaseException) -> SiteLost | None:
        """After a failed collective: ``SiteLost`` naming the sites silent for three beats, or None
        when every site is still beating. It waits up to seven beats for that silence to show: a
        peer counts as heard when its count is *seen* to move, and on a loaded machine this watch
        may see a dead peer's last beats a few seconds late (four beats were once too few)."""
        window = 3 * BEAT_S
        deadline = time.monotonic() + 2 * window + BEAT_S
        while time.monotonic() < deadline:
            silent = self.silent(window)
            if silent:
                return SiteLost(f"{silent} went away: no heartbeat for {window:g} s (killed, or its machine or "
                                f"link is down); site {self.rank}'s collective failed with: "
                                f"{str(failure).strip().splitlines()[-1] if str(failure).strip() else failure!r}")
            time.sleep(BEAT_S / 4)
        return None

    def finish(self) -> None:
        """This site is done (the others stop expecting its heartbeats); stop beating."""
        self.stop.set()
        try:
            self.store.set(f"retexo/done/{self.rank}", "1")  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001  (a store that is gone needs no goodbye)
            pass


def end_process(error_path: str, line: str) -> None:
    """Write ``line`` as the error report of this worker and end the process at once (exit code 1):
    its main thread is blocked in a collective that would wait for ``--timeout``."""
    with open(error_path, "w") as report:
        report.write(f"{SiteLost.__module__}.{SiteLost.__name__}: {line}\n")
    os._exit(1)
