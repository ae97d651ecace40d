"""``retexo store``: list the store's artefacts, collect what crashed writers left behind, verify
every artefact against its checksums (and remove the corrupt ones)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from cli.console import out, print_table
from cli.shared_options import StoreOption, open_store
from graphstore.catalog import refresh_catalog
from graphstore.integrity import verify_store
from graphstore.maintenance import garbage_collect, list_artefacts, remove_corrupt
from graphstore.units import human_bytes

store_app = typer.Typer(help="Inspect and maintain the store.", no_args_is_help=True)


@store_app.command("ls")
def store_ls_cmd(store: StoreOption = None) -> None:
    """List artefacts: kind, name, fingerprint, size, path."""
    st = open_store(store)
    rows = [[a.kind, a.name, a.fp, human_bytes(a.bytes), a.created_at, str(a.path.relative_to(st.root))]
            for a in list_artefacts(st)]
    print_table(f"store {st.root}", ["kind", "name", "fp", "size", "created", "path"], rows)


@store_app.command("gc")
def store_gc_cmd(store: StoreOption = None) -> None:
    """Remove temporary folders left behind by crashed writers (running writers are left alone), and
    mark runs left 'started' by a launcher that is gone as 'interrupted'."""
    st = open_store(store)
    removed, marked = garbage_collect(st)
    print_table(f"removed {len(removed)} temporary item(s)", ["path", "size"],
                [[str(p.relative_to(st.root)), human_bytes(b)] for p, b in removed])
    for run in marked:
        out.print(f"run {run}: its launcher is gone; marked interrupted", highlight=False)


VERIFY_HELP = (
    "Check every artefact against the sha256 checksums in its manifest, and every Parquet footer.\n\n"
    "Lists (kind, path, problem): unreadable manifests, listed files that are missing or changed since they were "
    "written, Parquet files whose footer cannot be read, and artefacts written before checksums were recorded "
    "(unverified: reported, never removed). With --repair the corrupt artefacts are removed under their writer "
    "locks: partitions, layers and runs are rebuilt by the next partition / train command, a removed dataset must "
    "be ingested again.\n\n"
    "Exit code 0: nothing corrupt (or all of it removed); 1: corrupt artefacts found and not removed."
)


@store_app.command("verify", help=VERIFY_HELP)
def store_verify_cmd(
    repair: Annotated[bool, typer.Option("--repair", help="Remove the corrupt artefacts so that the next run "
                                         "rebuilds them.")] = False,
    store: StoreOption = None,
) -> None:
    """``retexo store verify [--repair]`` (``graphstore.integrity.verify_store``, ``maintenance.remove_corrupt``)."""
    started = time.perf_counter()
    st = open_store(store)
    checks = verify_store(st)
    seconds = time.perf_counter() - started
    corrupt = [c for c in checks if c.corrupt]
    unverified = [c for c in checks if c.unverified and not c.corrupt]
    rows = [[c.kind, str(f.path.relative_to(st.root)), f.problem] for c in checks for f in c.findings]
    if rows:
        print_table(f"store {st.root}", ["kind", "path", "problem"], rows)
    out.print(f"{len(checks)} artefacts checked ({human_bytes(sum(c.bytes for c in checks))} of files read in "
              f"{seconds:.2f} s): {len(corrupt)} corrupt, {len(unverified)} unverified (no checksums), "
              f"{len(checks) - len(corrupt) - len(unverified)} intact", highlight=False)
    if not corrupt:
        return
    if not repair:
        out.print("run `retexo store verify --repair` to remove the corrupt artefacts", highlight=False)
        raise typer.Exit(1)
    removals = remove_corrupt(st, corrupt)
    refresh_catalog(st)
    print_table("repair", ["kind", "path", "outcome"],
                [[r.check.kind, str(r.check.folder.relative_to(st.root)), r.note] for r in removals])
    left = [r for r in removals if not r.resolved]
    out.print(f"repaired {len(removals) - len(left)} of {len(corrupt)} corrupt artefacts: the next `retexo partition` "
              "/ `retexo train` rebuilds partitions, layers and runs; ingest a removed dataset again", highlight=False)
    if left:
        raise typer.Exit(1)
