"""``retexo site provision`` and ``retexo site revoke``: a job's certificate authority, one kit per
site, and the revocation of a site's certificate (``runner.provision``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.console import err, out


def provision_cmd(
    folder: Annotated[Path, typer.Argument(help="New folder for the job: ca/ (keep it) and site-<r>/ (one kit per site).")],
    job: Annotated[str, typer.Option(help="The job's name, in every certificate.")],
    sites: Annotated[int, typer.Option(help="Number of sites (ranks 0..sites-1).")],
    names: Annotated[Optional[str], typer.Option(help="Comma list of the sites' names, by rank (default site-<r>).")] = None,
    days: Annotated[int, typer.Option(help="Days every certificate is valid.")] = 365,
) -> None:
    """Create a job's certificate authority and a kit per site (certificate, key, the CA and its
    revocation list). Copy site-<r>/ to site r's machine alone and pass it as `retexo site train --kit`."""
    from runner.provision import provision

    made = provision(folder, job, sites, names.split(",") if names else None, days)
    err.print(f"job {job}: {sites} sites, certificates valid until {made.expires:%Y-%m-%d %H:%M} UTC")
    out.print(f"{made.ca}  (the CA's key: keep it here, copy it to no site)", highlight=False, soft_wrap=True)
    for rank, kit in enumerate(made.kits):
        out.print(f"{kit}  (site {rank}: copy to that site only)", highlight=False, soft_wrap=True)


def revoke_cmd(
    folder: Annotated[Path, typer.Argument(help="The job's folder, as `retexo site provision` made it.")],
    rank: Annotated[int, typer.Option(help="The site whose certificate is revoked.")],
) -> None:
    """Revoke site RANK's certificate: the job's revocation list is rewritten in ca/ and in every
    kit under FOLDER; copy each kit's crl.pem to its site. A revoked site is refused by every site
    that has the new list."""
    from runner.provision import revoke

    for path in revoke(folder, rank):
        out.print(str(path), highlight=False, soft_wrap=True)
    err.print(f"site {rank}'s certificate is revoked; copy each kit's crl.pem to its site")
