"""A site's kit (``runner.provision`` writes it) as TLS 1.3 contexts, and who a peer is.

Both ends of every link present their certificate and check the other's against the job's CA and
its revocation list; the rank a peer may act as is the one its certificate names (``CN=site-<r>``).
Host names are not checked: sites are identified by certificate, not by address.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from graphstore.errors import RetexoError

KIT_FILES = ("ca.pem", "crl.pem", "site.pem", "site-key.pem")
SITE_CN = re.compile(r"^site-(\d+)$")


def site_common_name(rank: int) -> str:
    """The CN of site ``rank``'s certificate (what ``SITE_CN`` reads back)."""
    return f"site-{rank}"


class KitError(RetexoError):
    """A kit is missing a file, or is not this site's."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate says its holder is: the job (O), the site's rank (CN=site-<r>) and name (OU)."""

    job: str
    rank: int
    name: str

    def __str__(self) -> str:
        return f"site {self.rank} ({self.name})"


def identity_of(cert: dict) -> Identity | None:
    """The identity in a verified peer certificate (``SSLSocket.getpeercert()``), None without a site CN."""
    fields = {key: value for rdn in cert.get("subject", ()) for key, value in rdn}
    match = SITE_CN.match(fields.get("commonName", ""))
    if match is None:
        return None
    return Identity(fields.get("organizationName", ""), int(match.group(1)), fields.get("organizationalUnitName", ""))


@dataclass(frozen=True)
class Kit:
    """A site's kit folder: its certificate and key, the job's CA and revocation list."""

    folder: Path

    @classmethod
    def open(cls, folder: Path) -> Kit:
        missing = [name for name in KIT_FILES if not (folder / name).is_file()]
        if missing:
            raise KitError(f"{folder}: not a site kit, {', '.join(missing)} missing (made by `retexo site provision`)")
        return cls(folder)

    def identity(self) -> Identity:
        """This kit's own identity, read from ``site.pem``."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_pem_x509_certificate((self.folder / "site.pem").read_bytes())

        def field(oid: x509.ObjectIdentifier) -> str:
            values = cert.subject.get_attributes_for_oid(oid)
            return str(values[0].value) if values else ""

        match = SITE_CN.match(field(NameOID.COMMON_NAME))
        if match is None:
            raise KitError(f"{self.folder / 'site.pem'}: not a site certificate (expected CN=site-<rank>)")
        return Identity(field(NameOID.ORGANIZATION_NAME), int(match.group(1)), field(NameOID.ORGANIZATIONAL_UNIT_NAME))

    def context(self, server: bool) -> ssl.SSLContext:
        """A TLS 1.3 context that presents this site's certificate and requires the peer's, signed
        by the job's CA and not revoked (leaf checked against ``crl.pem``)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(self.folder / "site.pem", self.folder / "site-key.pem")
        context.load_verify_locations(self.folder / "ca.pem")
        context.load_verify_locations(self.folder / "crl.pem")
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        return context
