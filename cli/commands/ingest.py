"""``retexo ingest``: bring a graph into the store (Planetoid, .npz, OGB, your own tables, a
synthetic graph), validated and fingerprinted, and show the dataset written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from cli.console import print_table, progress_bars
from cli.options import OptionGroup, collect, with_options
from cli.shared_options import ForceOption, StoreOption, open_store
from graphstore.catalog import refresh_catalog
from graphstore.ingest.api import (check_name, ingest_mat, ingest_npz, ingest_ogb, ingest_planetoid, ingest_synthetic,
                                   ingest_tables)
from graphstore.ingest.features import REQUESTED_FORMAT_HELP, RequestedFormat
from graphstore.ingest.link_split import LinkSplitOptions, split_links
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.synthetic import SyntheticOptions
from graphstore.ingest.tables import TableOptions
from graphstore.lookup import DatasetRef, find_dataset

SYNTHETIC_OPTIONS = OptionGroup("synthetic", SyntheticOptions)
TABLE_OPTIONS = OptionGroup("tables", TableOptions, negatable=True)
SPLIT_OPTIONS = OptionGroup("split", SplitFractions)
LINK_OPTIONS = OptionGroup("link", LinkSplitOptions)
SPLIT_FRACTIONS = OptionGroup("split", SplitFractions, fields=("train", "val"))  # the split seed: the generator's

FeatureFormatOption = Annotated[RequestedFormat, typer.Option(help=REQUESTED_FORMAT_HELP)]

ingest_app = typer.Typer(help="Bring a graph into the store (validated, fingerprinted, Parquet).", no_args_is_help=True)


def show_dataset(ref: DatasetRef) -> None:
    """The dataset an ingest wrote (or found unchanged): its fingerprint and sizes."""
    status = "written" if ref.created else "unchanged (already in the store)"
    print_table(
        f"dataset {ref.name}: {status}",
        ["name", "fp", "nodes", "edges", "features", "classes"],
        [[ref.name, ref.fp, ref.num_nodes, ref.num_edges, ref.num_features, ref.num_classes]],
    )


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
    draw_split: Annotated[bool, typer.Option(help="Ignore the file's split masks and draw a stratified split "
                                                  "(--train-frac / --val-frac / --split-seed), as for a file "
                                                  "without masks.")] = False,
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
    masks, or any file with --draw-split, gets a stratified split."""
    st = open_store(store)
    fractions = collect(SPLIT_OPTIONS, options)
    show_dataset(ingest_npz(st, file, name, split_index, undirected, fractions, feature_format, force,
                            draw_split))  # type: ignore[arg-type]
    refresh_catalog(st)


@ingest_app.command("mat")
def ingest_mat_cmd(
    file: Annotated[Path, typer.Argument(help="A MATLAB .mat file holding an N x N adjacency matrix (v4 to v7.2).")],
    name: Annotated[str, typer.Option(help="Dataset name in the store.")],
    key: Annotated[Optional[str], typer.Option(help="The matrix's variable name (default: the file's only 2-D "
                                                    "matrix; SEAL's files call it net).")] = None,
    store: StoreOption = None,
) -> None:
    """Ingest a graph saved as an adjacency matrix (SEAL's link-prediction benchmarks, e.g. USAir.mat).

    Node ids are the rows 0..N-1, edges the non-zero entries off the diagonal; a symmetric matrix is stored
    undirected. Without features or labels in such files, node i gets the one-hot feature i (sparse): split its
    edges with `retexo ingest link-split` and train `--task link`."""
    st = open_store(store)
    show_dataset(ingest_mat(st, file, name, key))
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


@ingest_app.command("link-split")
@with_options(LINK_OPTIONS)
def ingest_link_split_cmd(
    source: Annotated[str, typer.Argument(help="The stored dataset to derive it from (name or fingerprint).")],
    name: Annotated[str, typer.Option(help="Name of the link dataset in the store.")],
    store: StoreOption = None,
    **options: Any,
) -> None:
    """Derive a link-prediction dataset: validation and test edges held out of the graph (with as many
    negative pairs, drawn once and stored), so that training (`retexo train --task link`) never sees them."""
    st = open_store(store)
    show_dataset(split_links(st, find_dataset(st, source), check_name(name), collect(LINK_OPTIONS, options)))  # type: ignore[arg-type]
    refresh_catalog(st)
