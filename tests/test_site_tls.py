"""Provisioned sites and their mutually authenticated TLS links (``runner.provision``,
``retexo_core.comm.tls``, ``retexo_core.comm.mesh``): who is admitted, who is refused and named,
and what a site learns when a peer goes away or freezes. Sites here are threads of this process (or
a child process, to freeze one) on 127.0.0.1; ``tests/test_sites.py`` trains provisioned sites in
network namespaces."""

from __future__ import annotations

import datetime as dt
import logging
import re
import resource
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from conftest import REPO
from graphstore.errors import RetexoError
from retexo_core.comm.mesh import HANDSHAKE_S, MeshTransport, SiteMesh, SiteRefused, connect
from retexo_core.comm.tls import Kit
from runner.launch import free_port
from runner.provision import provision, revoke

pytestmark = pytest.mark.slow
WAIT = timedelta(seconds=20)


def form_all(kits: list[Path], port: int, timeout_s: float = 30.0, hang_timeout_s: float = 20.0,
             ranks: list[int] | None = None, world: int | None = None) -> dict[int, SiteMesh | BaseException]:
    """Form the mesh of the sites of ``kits`` (each a thread; ``ranks`` default 0..K-1, of ``world``
    sites, default K); by index in ``kits``, the mesh or why it did not form."""
    ranks = ranks if ranks is not None else list(range(len(kits)))
    world = world or len(kits)
    formed: dict[int, SiteMesh | BaseException] = {}

    def site(k: int) -> None:
        try:
            formed[k] = SiteMesh.form(Kit.open(kits[k]), ranks[k], world, "127.0.0.1", port, timeout_s, hang_timeout_s)
        except BaseException as exc:  # noqa: BLE001  (reported to the test)
            formed[k] = exc

    threads = [threading.Thread(target=site, args=(k,)) for k in range(len(kits))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 15)
    return formed


def close_all(formed: dict[int, SiteMesh | BaseException]) -> None:
    for mesh in formed.values():
        if isinstance(mesh, SiteMesh):
            mesh.close()


def logged(caplog: pytest.LogCaptureFixture, pattern: str, count: int = 1, wait_s: float = 10.0) -> bool:
    """Whether ``count`` records match ``pattern`` within ``wait_s`` (a gatekeeper logs a failed
    handshake from its own thread, after the refused peer may already have given up)."""
    deadline = time.monotonic() + wait_s
    while sum(bool(re.search(pattern, r.getMessage())) for r in caplog.records) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("job") / "job"
    provision(folder, "hospitals", 3, ["north", "south", "lab"])
    return folder


def test_provisioning_writes_a_kit_per_site_and_refuses_to_overwrite(job: Path) -> None:
    assert sorted(p.name for p in job.iterdir()) == ["ca", "site-0", "site-1", "site-2"]
    assert sorted(p.name for p in (job / "site-1").iterdir()) == ["ca.pem", "crl.pem", "site-key.pem", "site.pem"]
    assert (job / "site-1" / "site-key.pem").stat().st_mode & 0o777 == 0o600
    assert not list(job.glob("site-*/ca-key.pem"))  # the CA's key stays in ca/
    assert str(Kit.open(job / "site-1").identity()) == "site 1 (south)"
    with pytest.raises(RetexoError, match="not empty; a job is provisioned once"):
        provision(job, "hospitals", 3)
    with pytest.raises(RetexoError, match=r"ca: not a site kit, site.pem, site-key.pem missing"):
        Kit.open(job / "ca")


def test_three_sites_form_a_mesh_and_move_exactly_the_bytes_sent(job: Path) -> None:
    formed = form_all([job / f"site-{r}" for r in range(3)], free_port())
    try:
        assert all(isinstance(m, SiteMesh) for m in formed.values()), formed
        results: dict[int, list[torch.Tensor]] = {}

        def exchange(rank: int) -> None:
            transport = MeshTransport(formed[rank])  # type: ignore[arg-type]
            sizes = [0 if (rank + j) % 3 == 0 else 3_000_000 * (j + 1) + rank for j in range(3)]  # some empty
            send = [torch.full((0 if (rank + j) % 3 == 0 else 3_000_000 * (rank + 1) + j,), 10 * rank + j,
                               dtype=torch.uint8) for j in range(3)]
            results[rank] = transport.all_to_all(send, sizes, WAIT)
            transport.barrier(WAIT)

        threads = [threading.Thread(target=exchange, args=(r,)) for r in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for rank in range(3):
            for j in range(3):
                got = results[rank][j]
                expected = 0 if (rank + j) % 3 == 0 else 3_000_000 * (j + 1) + rank
                assert got.numel() == expected
                assert expected == 0 or (got == 10 * j + rank).all()
    finally:
        close_all(formed)


def test_a_site_of_another_job_is_refused_at_both_ends_and_the_sites_form(
        job: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other = tmp_path / "other"
    provision(other, "hospitals", 3)  # the same job name, another CA
    caplog.set_level(logging.WARNING, "retexo.sites")
    port = free_port()
    outsider: dict[str, BaseException] = {}

    def intrude() -> None:
        kit = Kit.open(other / "site-1")
        try:
            connect(kit, kit.identity(), "127.0.0.1", port, 0, {"rank": 1, "world": 3}, time.monotonic() + 20)
        except SiteRefused as exc:
            outsider["refused"] = exc

    thread = threading.Thread(target=intrude)
    thread.start()
    formed = form_all([job / f"site-{r}" for r in range(3)], port)
    thread.join(30)
    try:
        assert all(isinstance(m, SiteMesh) for m in formed.values()), formed
        assert "TLS handshake with site 0 at 127.0.0.1" in str(outsider["refused"])
        assert "certificate verify failed: certificate signature failure" in str(outsider["refused"])
        assert logged(caplog, r"site 0 refused a connection from 127\.0\.0\.1:\d+: the TLS handshake failed: ")
    finally:
        close_all(formed)


def test_a_second_claimant_of_a_rank_is_refused_as_taken(job: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "retexo.sites")
    port = free_port()
    formed = form_all([job / f"site-{r}" for r in range(3)], port)
    try:
        assert all(isinstance(m, SiteMesh) for m in formed.values()), formed
        kit = Kit.open(job / "site-1")  # a copy of site 1's kit, used twice
        with pytest.raises(SiteRefused, match=r"^site 1: site 0 at 127.0.0.1:\d+ refused this site: "
                                              r"rank 1 is taken: site 1 \(south\) joined already$"):
            connect(kit, kit.identity(), "127.0.0.1", port, 0, {"rank": 1, "world": 3}, time.monotonic() + 10)
        assert any("site 0 refused site 1 (south) from 127.0.0.1:" in r.getMessage() and "rank 1 is taken" in
                   r.getMessage() for r in caplog.records), caplog.text
    finally:
        close_all(formed)


def test_a_certificate_that_claims_another_rank_is_refused(job: Path) -> None:
    port = free_port()
    listening = threading.Thread(target=form_all, args=([job / "site-0"], port, 8.0), kwargs={"ranks": [0], "world": 3})
    kit = Kit.open(job / "site-1")
    with pytest.raises(SiteRefused, match=r"refused this site: its certificate is site 1 \(south\)'s but it claims rank 2"):
        listening.start()
        connect(kit, kit.identity(), "127.0.0.1", port, 0, {"rank": 2, "world": 3}, time.monotonic() + 10)
    listening.join(20)
    with pytest.raises(SiteRefused, match=r"^--rank 2, but the kit at .*site-1 is site 1 \(south\)'s$"):
        SiteMesh.form(kit, 2, 3, "127.0.0.1", port, 1.0, 1.0)


def test_revoked_and_expired_certificates_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    provision(folder, "clinics", 2)
    revoke(folder, 1)
    formed = form_all([folder / "site-0", folder / "site-1"], free_port(), timeout_s=6.0)
    try:
        assert isinstance(formed[0], SiteRefused) and "site 1 never joined" in str(formed[0])
        assert isinstance(formed[1], SiteRefused) and "certificate revoked" in str(formed[1]), formed[1]
    finally:
        close_all(formed)

    expired = tmp_path / "expired"
    provision(expired, "clinics", 2)
    ca_key = serialization.load_pem_private_key((expired / "ca" / "ca-key.pem").read_bytes(), None)
    old = x509.load_pem_x509_certificate((expired / "site-1" / "site.pem").read_bytes())
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=10)
    lapsed = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(old.issuer).public_key(old.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(past)
              .not_valid_after(past + dt.timedelta(days=1)).sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (expired / "site-1" / "site.pem").write_bytes(lapsed.public_bytes(serialization.Encoding.PEM))
    formed = form_all([expired / "site-0", expired / "site-1"], free_port(), timeout_s=6.0)
    try:
        assert isinstance(formed[1], SiteRefused) and "certificate expired" in str(formed[1]), formed[1]
    finally:
        close_all(formed)


def test_a_site_that_goes_away_is_named_by_the_others(job: Path) -> None:
    formed = form_all([job / f"site-{r}" for r in range(3)], free_port())
    try:
        assert all(isinstance(m, SiteMesh) for m in formed.values()), formed
        formed[2].links[0].sock.close()  # type: ignore[union-attr]  # site 2's process dies: its sockets close
        formed[2].links[1].sock.close()  # type: ignore[union-attr]
        failed: dict[int, BaseException] = {}

        def wait_at_barrier(rank: int) -> None:
            try:
                MeshTransport(formed[rank]).barrier(WAIT)  # type: ignore[arg-type]
            except RuntimeError as exc:
                failed[rank] = exc

        threads = [threading.Thread(target=wait_at_barrier, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(re.match(r"^site 2 \(lab\) went away: it closed the connection$", str(failed[r])) for r in (0, 1)), failed
    finally:
        close_all(formed)


def test_a_site_that_stops_because_another_went_away_is_named_after_it(job: Path) -> None:
    """Site 2 dies; site 0 learns it first and leaves with a goodbye that says why; site 1, which
    then turns to site 0 first, names site 2 (whose link ended first), then site 0 and its reason
    (the goodbye read although the connection closed right after it). Site 1 waits until it has
    heard both, as a site busy computing would before its next exchange."""
    formed = form_all([job / f"site-{r}" for r in range(3)], free_port())
    try:
        assert all(isinstance(m, SiteMesh) for m in formed.values()), formed
        meshes: list[SiteMesh] = [formed[r] for r in range(3)]  # type: ignore[misc]
        meshes[2].links[0].sock.close()
        meshes[2].links[1].sock.close()
        deadline = time.monotonic() + 20
        while meshes[1].links[2].gone() is None or meshes[0].links[2].gone() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(RuntimeError) as first:
            MeshTransport(meshes[0]).barrier(WAIT)
        meshes[0].close(f"error: {first.value}")
        while meshes[1].links[0].gone() is None:  # site 1 has heard site 0 leave
            assert time.monotonic() < deadline + 20
            time.sleep(0.05)
        with pytest.raises(RuntimeError) as second:
            MeshTransport(meshes[1]).barrier(WAIT)
        assert re.match(r"^site 2 \(lab\) went away: it closed the connection$", str(first.value)), first.value
        said = str(second.value).split("; ")
        assert said[0] == "site 2 (lab) went away: it closed the connection", said
        assert said[1].startswith("site 0 (") and " went away: it stopped because error: site 2 (lab) went away" in said[1], said
    finally:
        close_all(formed)


FROZEN_SITE = """
import sys, time
from pathlib import Path
from retexo_core.comm.mesh import SiteMesh
from retexo_core.comm.tls import Kit
SiteMesh.form(Kit.open(Path(sys.argv[1])), 1, 2, "127.0.0.1", int(sys.argv[2]), 30, 30)
print("formed", flush=True)
time.sleep(120)
"""


def test_a_frozen_site_is_named_after_the_hang_timeout(job: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pair"
    provision(folder, "pair", 2)
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", FROZEN_SITE, str(folder / "site-1"), str(port)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        mesh = SiteMesh.form(Kit.open(folder / "site-0"), 0, 2, "127.0.0.1", port, 30, hang_timeout_s=3)
        assert child.stdout is not None and child.stdout.readline().strip() == "formed"
        child.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^site 1 \(site-1\): no heartbeat for [34] s \(frozen, or its link is cut\)$"):
            MeshTransport(mesh).barrier(WAIT)
        assert time.monotonic() - started < 6  # not the 20 s timeout
        mesh.close()
    finally:
        child.kill()
        child.wait(10)


def test_a_flood_of_idle_connections_does_not_keep_the_sites_apart(job: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    port = free_port()
    formed: dict[int, SiteMesh | BaseException] = {}
    flood: list[socket.socket] = []
    try:
        site0 = threading.Thread(target=lambda: formed.update(form_all([job / "site-0"], port, ranks=[0],
                                                                       world=3, timeout_s=40)))
        # site 0 of 3 alone first, so that the flood reaches its port before the other sites do
        others = threading.Thread(target=lambda: formed.update(
            {k + 1: m for k, m in form_all([job / "site-1", job / "site-2"], port, ranks=[1, 2], world=3, timeout_s=40).items()}))
        site0.start()
        time.sleep(0.5)
        for _ in range(2000):
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        assert len(flood) >= 1000
        started = time.monotonic()
        others.start()
        site0.join(60)
        others.join(60)
        assert all(isinstance(formed.get(r), SiteMesh) for r in range(3)), formed
        assert time.monotonic() - started < 3 * HANDSHAKE_S
    finally:
        for conn in flood:
            conn.close()
        close_all(formed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_process_without_a_certificate_is_refused_and_the_sites_form(
        job: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A TLS client that presents no certificate, and a client that speaks no TLS at all (a
    plaintext ``retexo site train`` reaching the port), are refused; the sites form."""
    caplog.set_level(logging.WARNING, "retexo.sites")
    port = free_port()
    refused: dict[str, BaseException] = {}

    def anonymous() -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5)) as tls:
                    tls.sendall(b"\x01\x00" + b"\x00" * 8)
                    tls.recv(1)
                return
            except ConnectionRefusedError:
                time.sleep(0.2)
            except (ssl.SSLError, OSError) as exc:
                refused["anonymous"] = exc
                return

    def plaintext() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    raw.sendall(b"not a TLS hello, a store client's request\n" * 4)
                    refused["plaintext"] = ConnectionError(raw.recv(64) or "closed")
                return
            except ConnectionRefusedError:
                time.sleep(0.2)
            except OSError as exc:
                refused["plaintext"] = exc
                return

    intruders = [threading.Thread(target=anonymous), threading.Thread(target=plaintext)]
    for thread in intruders:
        thread.start()
    formed = form_all([job / f"site-{r}" for r in range(3)], port)
    for thread in intruders:
        thread.join(30)
    try:
        assert all(isinstance(m, SiteMesh) for m in formed.values()), formed
        assert set(refused) == {"anonymous", "plaintext"}, refused
        assert logged(caplog, "the TLS handshake failed: peer did not return a certificate"), caplog.text
        assert logged(caplog, "site 0 refused a connection from 127.0.0.1:", count=2), caplog.text
    finally:
        close_all(formed)
