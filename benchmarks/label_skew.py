"""What ``--drift-correction`` decides by default on the suite's graphs, cut by each method.

For every graph of the development suite (each split the suite trains; one row where its seeds share one split) and every cut
(the suite's 4 random parts, seed 0, and METIS into 4), the test that ``--sync avg`` runs before
training: chi-square of part against train label, its p-value and the bias-corrected Cramér's V
(``retexo_core.label_skew``), and whether the correction turns on. The statistic is computed from
the whole table here, which equals what the ranks compute from their sums (``tests/test_drift_correction.py``).

    .venv/bin/python benchmarks/label_skew.py [--graphs cora,citeseer] [--methods random,metis] [--store DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import duckdb
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accuracy import SUITE, suite_partition  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from retexo_core.label_skew import LabelSkew, skew_of_table  # noqa: E402

PARTS = 4


def part_label_table(dataset_path: Path, partition_path: Path, num_classes: int) -> np.ndarray:
    """(parts, classes) counts of the train nodes' labels per part."""
    rows = duckdb.sql(f"""
        SELECT a.part, n.label, count(*) AS nodes
        FROM '{dataset_path / "nodes.parquet"}' n JOIN '{partition_path / "assignment.parquet"}' a USING (node_id)
        WHERE n.split = 'train' AND n.label >= 0 GROUP BY ALL""").fetchall()
    table = np.zeros((PARTS, num_classes))
    for part, label, nodes in rows:
        table[part, label] = nodes
    return table


def describe(skew: LabelSkew) -> str:
    return (f"{skew.chi2:9.1f} | {skew.df:3d} | {skew.p_value:8.1e} | {skew.cramers_v:.3f} | "
            f"{'on' if skew.differs else 'off'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", help="comma list: a part of the suite")
    parser.add_argument("--methods", default="random,metis", help="comma list of cuts (default: random,metis)")
    parser.add_argument("--datasets", type=Path, default=REPO.parent / "shared" / "datasets")
    parser.add_argument("--store", type=Path, help="a store to ingest into and reuse (default: a temporary one)")
    args = parser.parse_args()
    named = set(args.graphs.split(",")) if args.graphs else None
    graphs = [g for g in SUITE if named is None or g.name in named]
    with tempfile.TemporaryDirectory() as scratch:
        store = Store.open(args.store or Path(scratch) / "store")
        print("| graph | split | cut | train nodes | chi-square | df | p | Cramér's V | correction |")
        print("|---|---|---|---|---|---|---|---|---|")
        seen = set()  # Planetoid graphs train every seed on their one public split: one row
        for graph in graphs:
            for seed in range(graph.seeds(None)):
                for method in args.methods.split(","):
                    options = PartitionOptions(method=method, parts=PARTS, seed=0)
                    dataset, partition = suite_partition(store, graph, args.datasets, seed, options)
                    if (dataset.fp, method) in seen:
                        continue
                    seen.add((dataset.fp, method))
                    table = part_label_table(dataset.path, partition.path, dataset.num_classes)  # type: ignore[attr-defined]
                    skew = skew_of_table(table)
                    print(f"| {graph.name} | {seed} | {method} | {skew.nodes} | {describe(skew)} |", flush=True)


if __name__ == "__main__":
    main()
