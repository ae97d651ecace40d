"""Scheduled retraining across a data change: stable partitions and warm start against cold start.

For Cora and a generated SBM (10,000 nodes, the generator's harder defaults), version 1 is the
graph without 5 % of its nodes (chosen at random, with their edges) and version 2 the whole graph,
both exported as tables and ingested like a nightly export. Printed per graph:

- how many version-1 nodes a fresh METIS partition of version 2 moves to another part (under the
  best renaming of its parts), against
  ``stable_from`` (0 by construction), and both edge cuts;
- Retexo GCN on version 2 trained cold and warm-started from the version-1 run, over seeds:
  rounds trained (early stopping, patience 50), bytes sent, validation and test accuracy;
- the bytes of the promotion gate's re-evaluation of the version-1 model on version 2.

    .venv/bin/python benchmarks/retraining.py [--seeds 3] [--nodes 10000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common import cora, mb  # noqa: E402  (puts the project on sys.path)

from graphstore.ingest.api import ingest_synthetic, ingest_tables  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.synthetic import SyntheticOptions  # noqa: E402
from graphstore.ingest.tables import TableOptions, find_table_files  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef, PartitionRef  # noqa: E402
from graphstore.manifests import LayerManifest, RunManifest, read_manifest  # noqa: E402
from graphstore.parquet_io import read_table  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from retexo_core.config import TrainConfig  # noqa: E402
from runner.lifecycle import run_training  # noqa: E402
from runner.request import RunRequest, prepare_run  # noqa: E402

PARTS = 4


def export_versions(dataset: DatasetRef, folder: Path) -> list[Path]:
    """A stored dataset as two exports (its split kept): without 5 % of its nodes (at random, with
    their edges), and whole. Sparse features go to the sparse JSON format, dense ones to a list
    column."""
    nodes = pq.read_table(dataset.path / "nodes.parquet", columns=["node_id", "label", "split"])
    edges = pq.read_table(dataset.path / "edges.parquet")
    features = read_table(dataset.path / "features.parquet")
    node_id = nodes.column("node_id").to_numpy()
    dropped = np.random.default_rng(0).choice(node_id, len(node_id) // 20, replace=False)
    versions = []
    for version, drop in ((1, dropped), (2, dropped[:0])):
        out = folder / f"{dataset.name}-v{version}"
        out.mkdir(parents=True)
        keep = pa.array(~np.isin(node_id, drop))
        keep_edges = pa.array(~np.isin(edges.column("src").to_numpy(), drop) & ~np.isin(edges.column("dst").to_numpy(), drop))
        pq.write_table(nodes.filter(keep), out / "nodes.parquet")
        pq.write_table(edges.filter(keep_edges), out / "edges.parquet")
        kept = features.filter(pa.array(~np.isin(features.column("node_id").to_numpy(), drop)))
        if "x_idx" in kept.column_names:
            active = zip(kept.column("node_id").to_pylist(), kept.column("x_idx").to_pylist())
            (out / "features.json").write_text(json.dumps({str(n): idx for n, idx in active}))
        else:
            pq.write_table(kept.select(["node_id", "x"]), out / "features.parquet")
        versions.append(out)
    return versions


def ingest(store: Store, name: str, folder: Path) -> DatasetRef:
    """One export as a dataset (its split column is used as given), found as the pipeline finds it."""
    return ingest_tables(store, name, *find_table_files(folder), TableOptions(undirected=True), SplitFractions())


def moved_nodes(old: PartitionRef, new: PartitionRef) -> int:
    """Nodes of ``old`` that ``new`` assigns to another part, under the renaming of ``new``'s parts
    that moves the fewest (part numbers of a fresh partitioning are arbitrary)."""
    a = pq.read_table(old.path / "assignment.parquet").to_pandas().set_index("node_id")["part"]
    b = pq.read_table(new.path / "assignment.parquet").to_pandas().set_index("node_id")["part"]
    common = a.index.intersection(b.index)
    overlap = np.zeros((PARTS, PARTS), np.int64)
    np.add.at(overlap, (a[common].to_numpy(), b[common].to_numpy()), 1)
    kept = max(sum(overlap[naming[j], j] for j in range(PARTS)) for naming in itertools.permutations(range(PARTS)))
    return len(common) - int(kept)


def train(store: Store, dataset: DatasetRef, partition: PartitionRef, **options: Any) -> RunManifest:
    config = TrainConfig(**{"strategy": "retexo", "model": "gcn", "rounds": 200, "patience": 50,
                            "timeout_s": 600, **options})
    plan = prepare_run(RunRequest.over(store, dataset, partition, config), partitions="stored")
    summary, _ = run_training(plan)
    assert summary is not None
    return summary


def rounds_of(store: Store, run: RunManifest) -> int:
    return sum(read_manifest(store.layer_dir(run.fp, ref.layer), LayerManifest).rounds for ref in run.layers)


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f}±{statistics.pstdev(values):.4f}"


def compare(store: Store, name: str, folders: list[Path], seeds: int) -> None:
    v1, v2 = (ingest(store, f"{name}-v{k}", f) for k, f in ((1, folders[0]), (2, folders[1])))
    old = build_partition(store, v1, PartitionOptions(method="metis", parts=PARTS))
    fresh = build_partition(store, v2, PartitionOptions(method="metis", parts=PARTS))
    stable = build_partition(store, v2, PartitionOptions(method="metis", parts=PARTS, stable_from=old.fp))
    print(f"\n## {name}: version 1 {v1.num_nodes} nodes, version 2 {v2.num_nodes} nodes, METIS into {PARTS}\n")
    print("| partition of version 2 | version-1 nodes moved | edge cut |\n|---|---|---|")
    print(f"| fresh METIS | {moved_nodes(old, fresh):,} of {v1.num_nodes:,} | {fresh.edge_cut:,} |")
    print(f"| stable_from version 1 | {moved_nodes(old, stable):,} of {v1.num_nodes:,} | {stable.edge_cut:,} |")
    rows: dict[str, list[tuple[int, int, float, float]]] = {"cold": [], "warm": []}
    gate_bytes = []
    for seed in range(seeds):
        first = train(store, v1, old, seed=seed)
        for mode, warm in (("cold", None), ("warm", first.fp)):
            run = train(store, v2, stable, seed=seed, warm_start=warm)
            rows[mode].append((rounds_of(store, run), run.total_bytes, run.val_acc or 0.0, run.test_acc or 0.0))
        check = train(store, v2, stable, seed=seed, warm_start=first.fp, rounds=0)
        gate_bytes.append(check.total_bytes)
    print(f"\nRetexo GCN on version 2, {seeds} seeds (mean±sd), patience 50, at most 200 rounds per layer:\n")
    print("| start | rounds (both layers) | MB sent | val acc | test acc |\n|---|---|---|---|---|")
    for mode, values in rows.items():
        r, b, v, t = zip(*values)
        print(f"| {mode} | {statistics.mean(r):.0f} | {mb(statistics.mean(b))} | {spread(list(v))} | {spread(list(t))} |")
    print(f"\npromotion gate: re-evaluating the version-1 model on version 2 sends {mb(statistics.mean(gate_bytes))} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=10000, help="nodes of the generated SBM (version 2)")
    parser.add_argument("--store", type=Path, default=None, help="store to use (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(args.store or Path(tmp) / "store")
        exports = Path(tmp) / "exports"
        compare(store, "cora", export_versions(cora(store), exports), args.seeds)
        sbm = ingest_synthetic(store, "sbm", SyntheticOptions(nodes=args.nodes, avg_degree=10, seed=0),
                               SplitFractions(train=0.1, val=0.1, seed=0))
        compare(store, "sbm", export_versions(sbm, exports), args.seeds)


if __name__ == "__main__":
    main()
