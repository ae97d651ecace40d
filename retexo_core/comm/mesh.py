"""Sites linked by mutually authenticated TLS 1.3: admission, the mesh of links, and the transport over it.

With a kit (``retexo_core.comm.tls``), sites do not use torch's rendezvous store or gloo at all:
every byte between two sites crosses one TLS connection between them.

Forming the mesh (``SiteMesh.form``):

1. Every site listens: site 0 on ``--master-addr:--master-port``, every other site on an ephemeral
   port of its address towards site 0. A ``Gatekeeper`` thread accepts connections there and
   admits a peer only after the TLS handshake (its certificate signed by the job's CA, unexpired,
   not revoked) and its hello (the rank it claims must be the one its certificate names, one the
   gatekeeper expects, and not taken). Anything else is refused: one warning line in this site's
   log, and a ``REFUSE`` frame with the reason to the peer where the handshake got that far.
   Handshakes time out after ``HANDSHAKE_S``; at most ``MAX_PENDING`` run at once and further
   connections are closed at once, so a flood of idle connections costs the sites nothing but the
   retries of their own connections (which retry until ``--timeout``).
2. Site r > 0 connects to site 0 (retrying until ``--timeout``), says hello (its rank, and where it
   listens) and waits for the table of every site's address, which site 0 sends once all sites
   are admitted. Site r then connects to sites 1..r-1, and is connected to by sites r+1..K-1.

Once formed, each link is driven by one pump thread (non-blocking reads and writes on the TLS
socket, so two sites sending large payloads to each other never block one another). Frames are
``(kind, op, length)`` headers and payloads; the pump also sends a heartbeat frame whenever the link
has been quiet for ``BEAT_S``. A rank waiting for a peer's message fails with one line naming the
peer when its link closed (the site went away), when nothing arrived from it for
``--hang-timeout`` (frozen, or its link cut), or after ``--timeout``.

Like ``ThreadTransport``, every all-to-all sends a frame to every peer, also an empty one, so that
the n-th message on a link is the one the receiver's n-th operation expects, and a mismatch in
size or operation is detected.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from datetime import timedelta

import torch

from retexo_core.comm.tls import Identity, Kit, identity_of

HEADER = struct.Struct("!BBQ")  # frame kind, operation, payload length (bytes)
HELLO, WELCOME, REFUSE, TABLE, DATA, BEAT, BYE = range(1, 8)
OPS = {"all_to_all": 1, "barrier": 2}
BEAT_S = 1.0  # a link quiet for this long carries a heartbeat frame
HANDSHAKE_S = 10.0  # seconds a connection may take from accept to its hello
MAX_PENDING = 128  # handshakes under way at once; more connections are closed at once
CHUNK = 1 << 20  # bytes per non-blocking read or write

log = logging.getLogger("retexo.sites")


class SiteRefused(RuntimeError):
    """This site cannot join, or was refused by a peer (certificate, rank, job)."""


# ------------------------------------------------------------------------- blocking frames
def send_frame(sock: socket.socket, kind: int, payload: bytes = b"", op: int = 0) -> None:
    sock.sendall(HEADER.pack(kind, op, len(payload)) + payload)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, CHUNK))
        if not chunk:
            raise ConnectionError("the connection was closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(sock: socket.socket, limit: int = 1 << 20) -> tuple[int, int, bytes]:
    """One frame ``(kind, op, payload)`` of at most ``limit`` payload bytes (handshake frames are small)."""
    kind, op, size = HEADER.unpack(_read_exactly(sock, HEADER.size))
    if size > limit:
        raise ConnectionError(f"a {size} B frame during the handshake")
    return kind, op, _read_exactly(sock, size)


def local_address(towards: str) -> str:
    """The address of this machine's interface that routes to ``towards`` (no packet is sent)."""
    family, _, _, _, where = socket.getaddrinfo(towards, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


# ------------------------------------------------------------------------------ admission
class Gatekeeper:
    """Accepts connections on ``listener`` and admits the peers this site expects (see the module docstring).

    Attributes:
        admitted: rank -> (TLS socket, the peer's hello) of every admitted peer.
    """

    def __init__(self, listener: socket.socket, kit: Kit, me: Identity, expected: set[int]) -> None:
        self.listener = listener
        self.context = kit.context(server=True)
        self.me = me
        self.expected = expected
        self.admitted: dict[int, tuple[ssl.SSLSocket, dict]] = {}
        self._condition = threading.Condition()
        self._seated: set[int] = set()
        self._pending = 0
        threading.Thread(target=self._accept, name="retexo-gatekeeper", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    def _accept(self) -> None:
        while True:
            try:
                conn, where = self.listener.accept()
            except OSError:
                return  # closed
            with self._condition:
                crowded = self._pending >= MAX_PENDING
                self._pending += not crowded
            if crowded:
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn, f"{where[0]}:{where[1]}"), daemon=True).start()

    def _admit(self, conn: socket.socket, where: str) -> None:
        try:
            conn.settimeout(HANDSHAKE_S)
            try:
                tls = self.context.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                if isinstance(exc, ssl.SSLError):  # a TLS peer with a bad certificate, not a port scan
                    log.warning("site %d refused a connection from %s: the TLS handshake failed: %s", self.me.rank,
                                where, _reason(exc))
                conn.close()
                return
            try:
                kind, _, payload = read_frame(tls)
                hello = json.loads(payload) if kind == HELLO else {}
            except (OSError, ValueError, ConnectionError):
                tls.close()
                return
            hello = hello if isinstance(hello, dict) else {}
            peer = identity_of(tls.getpeercert() or {})
            refusal = self._refusal(peer, hello)
            if refusal is None:  # the seat is this peer's now
                try:
                    send_frame(tls, WELCOME)
                except OSError:
                    with self._condition:
                        self._seated.discard(peer.rank)  # type: ignore[union-attr]  # it left: the seat is free again
                    tls.close()
                    return
                with self._condition:
                    self.admitted[peer.rank] = (tls, hello)  # type: ignore[union-attr]
                    self._condition.notify_all()
                return
            log.warning("site %d refused %s from %s: %s", self.me.rank, peer or "a peer", where, refusal)
            try:
                send_frame(tls, REFUSE, refusal.encode())
            finally:
                tls.close()
        except OSError:
            conn.close()
        finally:
            with self._condition:
                self._pending -= 1

    def _refusal(self, peer: Identity | None, hello: dict) -> str | None:
        """Why ``peer`` (claiming ``hello``) may not join; None when it may, and then its seat is
        taken at once (two claimants of one rank: the first one in is admitted)."""
        if peer is None or peer.job != self.me.job:
            return "its certificate is not one of this job's sites"
        claimed = hello.get("rank")
        if claimed != peer.rank:
            return f"its certificate is {peer}'s but it claims rank {claimed}"
        with self._condition:
            if peer.rank in self._seated:
                return f"rank {peer.rank} is taken: {peer} joined already"
            if peer.rank not in self.expected:
                return f"rank {peer.rank} does not connect to site {self.me.rank} (world {hello.get('world')})"
            self._seated.add(peer.rank)
        return None

    def wait_for(self, ranks: set[int], deadline: float) -> dict[int, tuple[ssl.SSLSocket, dict]]:
        """The admitted peers of ``ranks`` once all are in; ``SiteRefused`` naming the missing ones at ``deadline``."""
        with self._condition:
            while not ranks <= self.admitted.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(f"site {r}" for r in sorted(ranks - self.admitted.keys()))
                    raise SiteRefused(f"site {self.me.rank}: {missing} never joined "
                                      f"(listening on {self.address[0]}:{self.address[1]})")
                self._condition.wait(min(left, 1.0))
            return {r: self.admitted[r] for r in ranks}

    def shut(self) -> None:
        """Stop accepting (until then, every later claimant of a seat is refused as taken)."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        except OSError:
            pass
        self.listener.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return (exc.reason or str(exc)).lower().replace("_", " ")
    return str(exc) or type(exc).__name__


def connect(kit: Kit, me: Identity, host: str, port: int, rank: int, hello: dict, deadline: float) -> ssl.SSLSocket:
    """A TLS link to site ``rank`` at ``host:port``, admitted; retried until ``deadline`` while
    nobody answers. ``SiteRefused`` (one line) when the peer is not site ``rank`` of this job, or
    refuses this site."""
    context = kit.context(server=False)
    where = f"site {rank} at {host}:{port}"
    while True:
        try:
            raw = socket.create_connection((host, port), timeout=HANDSHAKE_S)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SiteRefused(f"site {me.rank}: {where} never answered ({_reason(exc)})") from exc
            time.sleep(0.2)
            continue
        try:
            tls = context.wrap_socket(raw)
            peer = identity_of(tls.getpeercert() or {})
            if peer is None or peer.job != me.job or peer.rank != rank:
                tls.close()
                raise SiteRefused(f"site {me.rank}: {where} presents {peer or 'a certificate of no site'} "
                                  f"of job {peer.job if peer else '?'}, not site {rank} of job {me.job}")
            send_frame(tls, HELLO, json.dumps(hello).encode())
            kind, _, payload = read_frame(tls)
        except ssl.SSLError as exc:
            raw.close()
            if isinstance(exc, ssl.SSLEOFError) and time.monotonic() < deadline:
                continue  # closed before the handshake (a crowded gatekeeper): try again
            raise SiteRefused(f"site {me.rank}: the TLS handshake with {where} failed: {_reason(exc)}") from exc
        except (OSError, ConnectionError) as exc:
            raw.close()
            if time.monotonic() > deadline:
                raise SiteRefused(f"site {me.rank}: {where} did not admit this site ({_reason(exc)})") from exc
            time.sleep(0.2)
            continue
        if kind == WELCOME:
            return tls
        tls.close()
        raise SiteRefused(f"site {me.rank}: {where} refused this site: {payload.decode(errors='replace')}")


# ----------------------------------------------------------------------------------- links
class Link:
    """One admitted peer's TLS connection, driven by a pump thread (see the module docstring)."""

    def __init__(self, sock: ssl.SSLSocket, peer: Identity, hang_timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.hang_timeout_s = hang_timeout_s
        self._condition = threading.Condition()
        self._out: deque[memoryview] = deque()
        self._inbox: deque[tuple[int, bytearray]] = deque()
        self._gone: str | None = None  # why the link ended
        self.gone_at: float | None = None  # when (monotonic s) this site learnt it
        self._closing = False
        self._leaving = ""  # why this site stops (sent in the goodbye); empty: it finished
        self.last_heard = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._pump, name=f"retexo-link-{peer.rank}", daemon=True)
        self._thread.start()

    def send(self, op: str, payload: bytes) -> None:
        """Queue one data frame; returns at once (the pump writes it)."""
        with self._condition:
            if self._gone is not None:
                raise RuntimeError(f"{self.peer} went away: {self._gone}")
            self._queue(DATA, OPS[op], payload)

    def _queue(self, kind: int, op: int = 0, payload: bytes = b"") -> None:
        self._out.append(memoryview(HEADER.pack(kind, op, len(payload))))
        if payload:
            self._out.append(memoryview(payload))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is pending already

    def take(self, op: str, size: int, timeout: timedelta) -> bytearray:
        """The next data frame from the peer, checked to be ``op`` of ``size`` bytes."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._condition:
            while not self._inbox:
                if self._gone is not None:
                    raise RuntimeError(f"{self.peer} went away: {self._gone}")
                now = time.monotonic()
                if now - self.last_heard > self.hang_timeout_s:
                    self._set_gone(f"no heartbeat for {now - self.last_heard:.0f} s (frozen, or its link is cut)")
                    raise RuntimeError(f"{self.peer}: {self._gone}")
                if now > deadline:
                    raise RuntimeError(f"waited {timeout.total_seconds():g} s for {self.peer} ({op})")
                self._condition.wait(0.5)
            got_op, payload = self._inbox.popleft()
        if got_op != OPS[op]:
            raise RuntimeError(f"expected a {op} message from {self.peer} but got another operation's")
        if len(payload) != size:
            raise RuntimeError(f"expected {size} B from {self.peer} ({op}) but {len(payload)} B arrived")
        return payload

    def _pump(self) -> None:
        sock = self.sock
        buffer, sent_at = bytearray(), time.monotonic()
        poller = select.poll()  # not select(): descriptors above 1023 (a site under a flood of connections)
        try:
            sock.setblocking(False)  # inside: the link may be closed before its pump starts
            poller.register(self._wake_r, select.POLLIN)
            poller.register(sock, select.POLLIN)
            while True:
                with self._condition:
                    if self._gone is not None:
                        return  # nothing more can be said to this peer
                    writing = bool(self._out)
                    if self._closing and not writing:
                        self._say_goodbye(sock)
                        return
                poller.modify(sock, select.POLLIN | (select.POLLOUT if writing else 0))
                wait = 0 if sock.pending() else int(BEAT_S * 500)  # ms; decrypted bytes may wait in the TLS buffer
                events = dict(poller.poll(wait))
                if events.get(self._wake_r, 0) & select.POLLIN:
                    os.read(self._wake_r, 4096)
                mask = events.get(sock.fileno(), 0)
                if mask & (select.POLLIN | select.POLLHUP | select.POLLERR) or sock.pending():
                    self._read(sock, buffer)
                if mask & select.POLLOUT:
                    sent_at = self._write(sock) or sent_at
                if time.monotonic() - sent_at >= BEAT_S:
                    with self._condition:
                        self._queue(BEAT)
                    sent_at = time.monotonic()
        except (OSError, ConnectionError, ValueError) as exc:  # ValueError: the socket was closed under the pump
            self._end(str(exc) if isinstance(exc, ConnectionError) else _reason(exc))
        finally:
            self._end("the link closed")

    def _say_goodbye(self, sock: ssl.SSLSocket) -> None:
        """The last frame: why this site leaves (empty when it finished)."""
        sock.setblocking(True)
        sock.settimeout(HANDSHAKE_S)
        reason = self._leaving.encode()
        try:
            sock.sendall(HEADER.pack(BYE, 0, len(reason)) + reason)
        except OSError:
            pass

    def _read(self, sock: ssl.SSLSocket, buffer: bytearray) -> None:
        """Read what arrived and deliver its whole frames; ``ConnectionError`` at the end of the
        stream, after the frames that came before it (a goodbye just before the close is read)."""
        closed = False
        for _ in range(64):  # at most 64 MB before the pump writes again
            try:
                chunk = sock.recv(CHUNK)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if not chunk:
                closed = True
                break
            buffer += chunk
        position, frames = 0, []
        while len(buffer) - position >= HEADER.size:
            kind, op, size = HEADER.unpack_from(buffer, position)
            if len(buffer) - position - HEADER.size < size:
                break
            start = position + HEADER.size
            frames.append((kind, op, buffer[start:start + size]))
            position = start + size
        del buffer[:position]
        with self._condition:
            self.last_heard = time.monotonic()
            for kind, op, payload in frames:
                if kind == DATA:
                    self._inbox.append((op, payload))
                elif kind == BYE:
                    self._set_gone(f"it stopped because {payload.decode(errors='replace')}" if payload
                                   else "it finished and left")
            self._condition.notify_all()
        if closed:
            raise ConnectionError("it closed the connection")

    def _write(self, sock: ssl.SSLSocket) -> float | None:
        """Write what is queued until the socket would block; the time of the last write, if any."""
        wrote = None
        while True:
            with self._condition:
                if not self._out:
                    return wrote
                view = self._out[0]
            try:
                n = sock.send(view[:CHUNK])
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                return wrote
            wrote = time.monotonic()
            with self._condition:
                if n >= len(view):
                    self._out.popleft()
                else:
                    self._out[0] = view[n:]

    def _set_gone(self, reason: str) -> None:
        """The link's end and why (the first reason stays); call with ``_condition`` held."""
        if self._gone is None:
            self._gone, self.gone_at = reason, time.monotonic()

    def gone(self) -> str | None:
        """``"<peer> went away: <why>"`` once the link ended, else None."""
        with self._condition:
            return None if self._gone is None else f"{self.peer} went away: {self._gone}"

    def _end(self, reason: str) -> None:
        with self._condition:
            self._set_gone(reason)
            self._condition.notify_all()

    def close(self, reason: str = "", timeout_s: float = 30.0) -> None:
        """Write what is queued and a goodbye (``reason``: why this site stops, empty when it
        finished), then close the connection."""
        with self._condition:
            self._closing = True
            self._leaving = reason
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout_s if self._gone is None else 1.0)
        for closing in (self.sock.close, lambda: os.close(self._wake_r), lambda: os.close(self._wake_w)):
            try:
                closing()
            except OSError:
                pass


# ------------------------------------------------------------------------------------ mesh
class SiteMesh:
    """The K sites' links, from this site's side (see the module docstring)."""

    def __init__(self, me: Identity, world: int, links: dict[int, Link], gatekeeper: Gatekeeper) -> None:
        self.me = me
        self.world = world
        self.links = links
        self.gatekeeper = gatekeeper

    @classmethod
    def form(cls, kit: Kit, rank: int, world: int, master_addr: str, master_port: int, timeout_s: float,
             hang_timeout_s: float) -> SiteMesh:
        """Admit and connect every site within ``timeout_s``; ``SiteRefused`` (one line) otherwise."""
        me = kit.identity()
        if me.rank != rank:
            raise SiteRefused(f"--rank {rank}, but the kit at {kit.folder} is {me}'s")
        deadline = time.monotonic() + timeout_s
        host = master_addr if rank == 0 else local_address(master_addr)
        family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]  # IPv4 or IPv6, as the address is
        listener = socket.create_server((host, master_port if rank == 0 else 0), family=family, backlog=socket.SOMAXCONN)
        gatekeeper = Gatekeeper(listener, kit, me, set(range(1, world)) if rank == 0 else set(range(rank + 1, world)))
        try:
            sockets = cls._connect_all(kit, me, rank, world, master_addr, master_port, gatekeeper, deadline)
        except BaseException:
            gatekeeper.shut()
            raise
        links = {peer: Link(sock, identity_of(sock.getpeercert() or {}) or me, hang_timeout_s)
                 for peer, sock in sockets.items()}
        log.info("site %d: TLS links to %s", rank, ", ".join(str(link.peer) for link in links.values()))
        return cls(me, world, links, gatekeeper)

    @staticmethod
    def _connect_all(kit: Kit, me: Identity, rank: int, world: int, master_addr: str, master_port: int,
                     gatekeeper: Gatekeeper, deadline: float) -> dict[int, ssl.SSLSocket]:
        hello = {"rank": rank, "world": world, "host": gatekeeper.address[0], "port": gatekeeper.address[1]}
        if rank == 0:
            admitted = gatekeeper.wait_for(set(range(1, world)), deadline)
            table = json.dumps({r: [h["host"], h["port"]] for r, (_, h) in admitted.items()}).encode()
            for sock, _ in admitted.values():
                send_frame(sock, TABLE, table)
            return {r: sock for r, (sock, _) in admitted.items()}
        first = connect(kit, me, master_addr, master_port, 0, hello, deadline)
        first.settimeout(max(deadline - time.monotonic(), 1.0))
        try:
            kind, _, payload = read_frame(first)
        except (OSError, ConnectionError) as exc:
            raise SiteRefused(f"site {rank}: site 0 did not send the sites' addresses ({_reason(exc)})") from exc
        if kind != TABLE:
            raise SiteRefused(f"site {rank}: site 0 sent frame {kind} instead of the sites' addresses")
        table = {int(r): (h, int(p)) for r, (h, p) in json.loads(payload).items()}
        sockets = {0: first}
        for lower in range(1, rank):
            sockets[lower] = connect(kit, me, *table[lower], lower, hello, deadline)
        sockets.update({r: sock for r, (sock, _) in gatekeeper.wait_for(set(range(rank + 1, world)), deadline).items()})
        return sockets

    def close(self, reason: str = "") -> None:
        """Flush and close every link, saying goodbye with ``reason`` (why this site stops, empty
        when it finished: a peer that waits for it names that reason), and stop admitting."""
        for link in self.links.values():
            link.close(reason[:2000])
        self.gatekeeper.shut()


def _tensor(payload: bytearray) -> torch.Tensor:
    """(n,) uint8 over ``payload`` (no copy)."""
    return torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)


class MeshTransport:
    """The ``Transport`` of a site over its ``SiteMesh`` (ranks are site ranks)."""

    def __init__(self, mesh: SiteMesh) -> None:
        self.mesh = mesh
        self.rank = mesh.me.rank

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int], timeout: timedelta) -> list[torch.Tensor]:
        self._send_all("all_to_all", {j: send[j].detach().contiguous().reshape(-1).numpy().tobytes()
                                      for j in self.mesh.links})
        received = {j: _tensor(payload) for j, payload in self._take_all("all_to_all", recv_sizes, timeout).items()}
        received[self.rank] = send[self.rank].detach().reshape(-1).clone()
        return [received[j] for j in range(self.mesh.world)]

    def barrier(self, timeout: timedelta) -> None:
        self._send_all("barrier", dict.fromkeys(self.mesh.links, b""))
        self._take_all("barrier", [0] * self.mesh.world, timeout)

    def _send_all(self, op: str, payloads: dict[int, bytes]) -> None:
        """Queue ``payloads[j]`` for every peer j (``_naming_earlier`` when a link has ended)."""
        for j, link in self.mesh.links.items():
            try:
                link.send(op, payloads[j])
            except RuntimeError as exc:
                raise self._naming_earlier(j, exc) from exc

    def _take_all(self, op: str, sizes: list[int], timeout: timedelta) -> dict[int, bytearray]:
        """Every peer's next ``op`` frame, peer by peer (``_naming_earlier`` when one fails)."""
        received = {}
        for j, link in self.mesh.links.items():
            try:
                received[j] = link.take(op, sizes[j], timeout)
            except RuntimeError as exc:
                raise self._naming_earlier(j, exc) from exc
        return received

    def _naming_earlier(self, failed: int, exc: RuntimeError) -> RuntimeError:
        """``exc`` (peer ``failed``'s link) after the peers whose links ended before that one's, in
        the order they ended: when a site dies, a second site may stop because of it before a third
        site turns to the first, and the third then names the site that went away first."""
        links = self.mesh.links
        ended = links[failed].gone_at
        ended = time.monotonic() if ended is None else ended
        earlier = sorted((link for k, link in links.items() if k != failed and link.gone_at is not None
                          and link.gone_at <= ended), key=lambda link: link.gone_at or 0.0)
        return RuntimeError("; ".join([*(str(link.gone()) for link in earlier), str(exc)]))
