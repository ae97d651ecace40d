"""``retexo partition``: partition a stored dataset and show each part's statistics."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli.console import print_table, progress_bars
from cli.options import OptionGroup, collect, with_options
from cli.shared_options import ForceOption, StoreOption, open_store
from graphstore.catalog import refresh_catalog
from graphstore.layout import Store
from graphstore.lookup import PartitionRef, find_dataset
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.sql_query import query

PARTITION_OPTIONS = OptionGroup("partition", PartitionOptions)


def show_partition(store: Store, ref: PartitionRef) -> None:
    """The partition built (or found unchanged): its edge cut, halo and each part's statistics."""
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
