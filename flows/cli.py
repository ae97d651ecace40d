"""The ``retexo`` command line: ingest, partition, sql, store, report here; the training commands
(train, worker, run) are in ``flows.cli_training`` and join at start-up, so that the data commands
never import the training core."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError
from rich.markup import escape

from flows.console import err, out, print_table, progress_bars
from graphstore.catalog import refresh_catalog, refresh_if_moved
from graphstore.sql_query import DEFAULT_TIMEOUT_S, open_query, query
from graphstore.errors import RetexoError, describe_validation_error
from graphstore.units import human_bytes
from graphstore.ingest.api import ingest_npz, ingest_ogb, ingest_planetoid, ingest_synthetic, ingest_tables
from graphstore.ingest.features import REQUESTED_FORMAT_HELP, RequestedFormat
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.synthetic import SyntheticOptions
from graphstore.ingest.tables import TableOptions
from flows.options import OptionGroup, collect, with_options
from graphstore.layout import STORE_ENV, Store
from graphstore.lookup import DatasetRef, PartitionRef, find_dataset
from graphstore.integrity import verify_store
from graphstore.maintenance import garbage_collect, list_artefacts, remove_corrupt
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions

PARTITION_OPTIONS = OptionGroup("partition", PartitionOptions)
SYNTHETIC_OPTIONS = OptionGroup("synthetic", SyntheticOptions)
TABLE_OPTIONS = OptionGroup("tables", TableOptions, negatable=True)
SPLIT_OPTIONS = OptionGroup("split", SplitFractions)
SPLIT_FRACTIONS = OptionGroup("split", SplitFractions, fields=("train", "val"))  # the split seed: the generator's

app = typer.Typer(
    help="Communication-efficient distributed GNN training: ingest, partition, train, inspect with SQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
ingest_app = typer.Typer(help="Bring a graph into the store (validated, fingerprinted, Parquet).", no_args_is_help=True)
store_app = typer.Typer(help="Inspect and maintain the store.", no_args_is_help=True)
app.add_typer(ingest_app, name="ingest")
app.add_typer(store_app, name="store")

StoreOption = Annotated[
    Optional[Path],
    typer.Option("--store", envvar=STORE_ENV, help="Store root directory (default ./retexo-store; env RETEXO_STORE)."),
]
ForceOption = Annotated[bool, typer.Option("--force", help="Go on even when the memory estimate exceeds the memory available now.")]
FeatureFormatOption = Annotated[RequestedFormat, typer.Option(help=REQUESTED_FORMAT_HELP)]


OPENED_STORES: list[Path] = []  # the roots this command opened, named by an OS error without a file name


def open_store(path: Path | None) -> Store:
    """The store at ``path`` (or $RETEXO_STORE, or ./retexo-store). When it was copied, moved or
    mounted elsewhere, its ``catalog.duckdb`` is rewritten for its path now, and one line says so."""
    store = Store.open(path)
    OPENED_STORES.append(store.root)
    moved = refresh_if_moved(store)
    if moved is not None:
        err.print(moved.message(store.root), highlight=False)
    return store


def show_dataset(ref: DatasetRef) -> None:
    status = "written" if ref.created else "unchanged (already in the store)"
    print_table(
        f"dataset {ref.name}: {status}",
        ["name", "fp", "nodes", "edges", "features", "classes"],
        [[ref.name, ref.fp, ref.num_nodes, ref.num_edges, ref.num_features, ref.num_classes]],
    )


def show_partition(store: Store, ref: PartitionRef) -> None:
    status = "written" if ref.created else "unchanged (already in the store)"
    columns, rows = query(
        store,
        "SELECT part, owned_nodes, local_edges, cut_edges, halo_nodes, train, val, test, balance "
        f"FROM partition_stats WHERE partition = '{ref.fp}' ORDER BY part",
    )
    m = ref.manifest
    anchor = (f"; stable from {m.stable_from}: {m.kept_nodes} nodes kept their part, {m.moved_nodes} moved, "
              f"{m.new_nodes} new" if m.stable_from else "")
    print_table(f"partition {ref.fp} ({ref.method}, {ref.parts} parts): {status}; edge cut {ref.edge_cut}, "
                f"halo total {ref.halo_total}{anchor}", columns, rows)


@ingest_app.command("planetoid")
def ingest_planetoid_cmd(
    directory: Annotated[Path, typer.Argument(help="Folder with ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}.")],
    name: Annotated[str, typer.Option(help="Dataset name in the store.")],
    feature_format: FeatureFormatOption = "auto",
    store: StoreOption = None,
) -> None:
    """Ingest a Planetoid data set (Cora, CiteSeer, PubMed raw files) with its public split."""
    st = open_store(store)
    show_dataset(ingest_planetoid(st, directory, name, feature_format))
    refresh_catalog(st)


@ingest_app.command("npz")
@with_options(SPLIT_OPTIONS)
def ingest_npz_cmd(
    file: Annotated[Path, typer.Argument(help="An .npz graph (heterophilous-graphs or gnn-benchmark layout), or a .zip "
                                              "holding one .npz (read in memory, not extracted).")],
    name: Annotated[str, typer.Option(help="Dataset name in the store.")],
    split_index: Annotated[Optional[int], typer.Option(min=0, help="Which of the file's official splits (row of "
                                                                    "train_masks / val_masks / test_masks); default 0.")] = None,
    undirected: Annotated[bool, typer.Option("--undirected/--directed", help="Store every edge in both directions "
                                             "(default: both layouts hold undirected graphs); --directed keeps the "
                                             "edges as the file lists them.")] = True,
    feature_format: Annotated[RequestedFormat, typer.Option(help="How features are stored: sparse or dense; auto "
                                                                 "stores them sparse at density <= 0.1.")] = "auto",
    force: ForceOption = False,
    store: StoreOption = None,
    **options: Any,
) -> None:
    """Ingest an .npz graph (heterophilous-graphs or gnn-benchmark layout), or a .zip holding one.

    Keys node_features, node_labels, edges and optional train_masks / val_masks / test_masks (heterophilous-graphs),
    or CSR adj_*, attr_* (or attr_matrix) and labels (gnn-benchmark). Node ids are the rows 0..N-1; edges are stored
    in both directions unless --directed; feature values are kept as the file gives them. A file without split
    masks gets a stratified split."""
    st = open_store(store)
    fractions = collect(SPLIT_OPTIONS, options)
    show_dataset(ingest_npz(st, file, name, split_index, undirected, fractions, feature_format, force))  # type: ignore[arg-type]
    refresh_catalog(st)


@ingest_app.command("ogb")
def ingest_ogb_cmd(
    directory: Annotated[Path, typer.Argument(help="Root folder holding <name with _>/ in OGB's layout (no download).")],
    name: Annotated[str, typer.Option(help="OGB data set name, e.g. ogbn-arxiv.")],
    undirected: Annotated[bool, typer.Option(help="Add reverse edges (e.g. for ogbn-arxiv).")] = False,
    feature_format: FeatureFormatOption = "auto",
    store: StoreOption = None,
) -> None:
    """Ingest an OGB node-property data set from a local folder through the ogb package."""
    st = open_store(store)
    show_dataset(ingest_ogb(st, directory, name, undirected, feature_format))
    refresh_catalog(st)


@ingest_app.command("tables")
@with_options(TABLE_OPTIONS, SPLIT_OPTIONS)
def ingest_tables_cmd(
    edges: Annotated[Path, typer.Option(help="CSV or Parquet edge list.")],
    nodes: Annotated[Path, typer.Option(help="CSV or Parquet with node_id, label (-1 unknown), optional split.")],
    name: Annotated[str, typer.Option(help="Dataset name in the store.")],
    features: Annotated[Optional[Path], typer.Option(help="CSV/Parquet (node_id + f0..fN or one list column) or JSON {node id: [active feature ids]}.")] = None,
    force: ForceOption = False,
    store: StoreOption = None,
    **options: Any,
) -> None:
    """Ingest your own graph from edge / node / feature tables (the format: docs/ingest.md)."""
    st = open_store(store)
    tables, fractions = collect(TABLE_OPTIONS, options), collect(SPLIT_OPTIONS, options)
    show_dataset(ingest_tables(st, name, edges, nodes, features, tables, fractions, force))  # type: ignore[arg-type]
    refresh_catalog(st)


@ingest_app.command("synthetic")
@with_options(SYNTHETIC_OPTIONS, SPLIT_FRACTIONS)
def ingest_synthetic_cmd(
    name: Annotated[str, typer.Option(help="Dataset name in the store.")],
    force: ForceOption = False,
    store: StoreOption = None,
    **options: Any,
) -> None:
    """Generate a stochastic block model with label-correlated features, streamed to Parquet."""
    st = open_store(store)
    synthetic = collect(SYNTHETIC_OPTIONS, options)
    fractions = collect(SPLIT_FRACTIONS, options, seed=synthetic.seed)  # type: ignore[attr-defined]
    with progress_bars() as progress:
        ref = ingest_synthetic(st, name, synthetic, fractions, progress, force)  # type: ignore[arg-type]
    show_dataset(ref)
    refresh_catalog(st)


@app.command("partition")
@with_options(PARTITION_OPTIONS)
def partition_cmd(
    dataset: Annotated[str, typer.Argument(help="Dataset name (newest version) or fingerprint.")],
    force: ForceOption = False,
    store: StoreOption = None,
    **options: Any,
) -> None:
    """Partition a dataset: owned nodes, local edges and halo lists per part, plus stats."""
    st = open_store(store)
    options = collect(PARTITION_OPTIONS, options)
    ref_dataset = find_dataset(st, dataset)
    with progress_bars() as progress:
        ref = build_partition(st, ref_dataset, options, progress, force)
    refresh_catalog(st)
    show_partition(st, ref)


@app.command("sql")
def sql_cmd(
    statement: Annotated[str, typer.Argument(help="A SELECT query over the catalog views (datasets, nodes, edges, partitions, ...).")],
    format: Annotated[str, typer.Option("--format", help="table | csv | json.")] = "table",
    timeout: Annotated[float, typer.Option("--timeout", help="Stop the query after this many seconds.")] = DEFAULT_TIMEOUT_S,
    store: StoreOption = None,
) -> None:
    """Run a read-only SQL query over the store's views; it can read the store's files and nothing else.

    CSV and JSON stream every row of the result as DuckDB produces it (the process holds one batch
    of rows at a time); a table shows the first 1000 rows. The time limit covers the whole output."""
    if format not in ("table", "csv", "json"):
        raise RetexoError(f"--format must be table, csv or json, not '{format}'")
    with open_query(open_store(store), statement, timeout) as result:
        print_table(None, result.columns, result.rows(), format)


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


@app.command("report")
def report_cmd(
    run: Annotated[str, typer.Argument(help="Run fingerprint (or a unique prefix).")],
    store: StoreOption = None,
) -> None:
    """Regenerate a run's markdown report and accuracy-vs-bytes plot; prints the PNG's path."""
    from graphstore.report import write_report

    report = write_report(open_store(store), run)
    out.print(report.markdown, markup=False, highlight=False)
    typer.echo(str(report.plot_path))


def main() -> None:
    from flows.cli_training import register_training_commands

    level = os.environ.get("RETEXO_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # also for loggers with their own level (Prefect's INFO):
        handler.setLevel(level)  # their records still reach the Prefect API, not the console
    register_training_commands(app)
    try:
        app()
    except RetexoError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)  # paths/values may hold [brackets]
        raise SystemExit(2) from None
    except ValidationError as exc:
        err.print(f"[bold red]error:[/] {escape(describe_validation_error(exc, 'invalid option'))}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise SystemExit(1) from None
    except OSError as exc:  # a full disk, a read-only or vanished file system, permissions
        err.print(f"[bold red]error:[/] {escape(os_error_line(exc))}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except MemoryError as exc:  # more than the estimate foresaw, or a memory limit set on the process
        err.print(f"[bold red]error:[/] out of memory ({escape(str(exc) or 'no detail')}): nothing half-written "
                  "is left in the store; free memory, or make the request smaller", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None


def os_error_line(exc: OSError) -> str:
    """One line for an operating-system error: what happened and where (the file it names; else the
    store the command opened, with the free space of its file system)."""
    what = os.strerror(exc.errno) if exc.errno else str(exc)
    said = f": {exc.strerror}" if exc.strerror and exc.strerror != what else ""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    if paths:
        return f"{what.lower()}: {' -> '.join(paths)}{said}"
    if not OPENED_STORES:
        return f"{what.lower()}{said}"
    root = OPENED_STORES[-1]
    try:
        where = f"the store {root} ({human_bytes(shutil.disk_usage(root).free)} free)"
    except OSError:
        where = f"the store {root}"
    if exc.errno == errno.ENOSPC:
        return f"no space left on device, writing to {where}: free some space, or use a store on another disk (--store)"
    return f"{what.lower()} in {where}{said}"


if __name__ == "__main__":
    main()
