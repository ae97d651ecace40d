"""Provisioning a job of sites: a certificate authority and one kit per site (``retexo site provision``),
and revoking a site's certificate (``retexo site revoke``).

The layout written under the job's folder::

    <dir>/ca/ca.pem          the job's CA certificate (public)
    <dir>/ca/ca-key.pem      the CA's private key: stays with whoever provisions, never copied to a site
    <dir>/ca/crl.pem         the CA's revocation list (public)
    <dir>/site-<r>/          the kit of site r, copied to that site's machine alone:
        ca.pem, crl.pem      the CA's certificate and revocation list
        site.pem             site r's certificate: O=<job>, CN=site-<r>, OU=<name>
        site-key.pem         site r's private key (mode 0600)

Keys are ECDSA P-256 and certificates are signed with SHA-256 (the ``cryptography`` library). A
site's rank is in its certificate (``CN=site-<r>``): a peer is admitted as the rank its certificate
names, and only as that one (``retexo_core.comm.mesh``).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from graphstore.errors import RetexoError
from retexo_core.comm.tls import site_common_name

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ProvisionError(RetexoError):
    """The job folder cannot be provisioned or changed as asked."""


@dataclass(frozen=True)
class Provisioned:
    """What ``provision`` wrote: the CA folder and each site's kit folder (by rank)."""

    ca: Path
    kits: list[Path]
    expires: dt.datetime


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data)


def _pem(cert: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _crl(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, serials: list[int],
         now: dt.datetime) -> x509.CertificateRevocationList:
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
               .next_update(ca_cert.not_valid_after_utc))
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    return builder.sign(ca_key, hashes.SHA256())


def provision(folder: Path, job: str, sites: int, names: list[str] | None = None, days: int = 365) -> Provisioned:
    """Write a new CA and ``sites`` kits under ``folder`` (which must not exist or be empty).

    ``names``: one display name per site (default ``site-<r>``); ``days``: validity of every
    certificate. Raises ``ProvisionError`` (one line) on a bad argument or an existing job."""
    if not NAME.match(job):
        raise ProvisionError(f"--job {job!r}: expected letters, digits, '.', '_' or '-' (at most 63)")
    if sites < 2:
        raise ProvisionError(f"--sites {sites}: a job of sites needs at least 2")
    names = names or [f"site-{r}" for r in range(sites)]
    if len(names) != sites or not all(NAME.match(n) for n in names) or len(set(names)) != sites:
        raise ProvisionError(f"--names: expected {sites} distinct names of letters, digits, '.', '_' or '-'")
    if days < 1:
        raise ProvisionError(f"--days {days}: expected at least 1")
    if folder.exists() and any(folder.iterdir()):
        raise ProvisionError(f"{folder}: not empty; a job is provisioned once (its keys are never overwritten)")
    now = dt.datetime.now(dt.timezone.utc)
    expires = now + dt.timedelta(days=days)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, job),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"{job} certificate authority")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(expires)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca = folder / "ca"
    ca.mkdir(parents=True)
    _write_key(ca / "ca-key.pem", ca_key)
    (ca / "ca.pem").write_bytes(_pem(ca_cert))
    crl = _pem(_crl(ca_cert, ca_key, [], now))
    (ca / "crl.pem").write_bytes(crl)
    kits = []
    for rank, name in enumerate(names):
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, job),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, name),
                             x509.NameAttribute(NameOID.COMMON_NAME, site_common_name(rank))])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(expires)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                      x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        kit = folder / f"site-{rank}"
        kit.mkdir()
        _write_key(kit / "site-key.pem", key)
        (kit / "site.pem").write_bytes(_pem(cert))
        (kit / "ca.pem").write_bytes(_pem(ca_cert))
        (kit / "crl.pem").write_bytes(crl)
        kits.append(kit)
    return Provisioned(ca, kits, expires)


def revoke(folder: Path, rank: int) -> list[Path]:
    """Add site ``rank``'s certificate to the job's revocation list and write the list to the CA
    folder and to every kit under ``folder``; returns the files written (copy each kit's
    ``crl.pem`` to its site). Raises ``ProvisionError`` when ``folder`` is no provisioned job."""
    ca = folder / "ca"
    kit = folder / f"site-{rank}"
    for path in (ca / "ca-key.pem", ca / "ca.pem", ca / "crl.pem", kit / "site.pem"):
        if not path.is_file():
            raise ProvisionError(f"{path}: missing; expected a job provisioned by `retexo site provision`")
    ca_key = serialization.load_pem_private_key((ca / "ca-key.pem").read_bytes(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ProvisionError(f"{ca / 'ca-key.pem'}: expected the CA's ECDSA key")
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
    revoked = [r.serial_number for r in x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())]
    serial = x509.load_pem_x509_certificate((kit / "site.pem").read_bytes()).serial_number
    crl = _pem(_crl(ca_cert, ca_key, sorted(set(revoked) | {serial}), dt.datetime.now(dt.timezone.utc)))
    written = [ca / "crl.pem", *sorted(folder.glob("site-*/crl.pem"))]
    for path in written:
        path.write_bytes(crl)
    return written
