"""Every strategy on the same partitions: accuracy, bytes by kind, simulated time on three networks.

Cora and a dense synthetic SBM (average degree >= 100), 4 random partitions (plus supernode
partitions for SuperTMA), GCN, 2 layers, hidden 256. Networks: data center (10 Gbit/s, 0.1 ms),
WAN (100 Mbit/s, 20 ms), edge (10 Mbit/s, 50 ms). Writes the accuracy-vs-bytes plot next to the
output (``--plot-dir``).

    .venv/bin/python benchmarks/compare_strategies.py --store /tmp/bench-store
    .venv/bin/python benchmarks/compare_strategies.py --rounds 5 --dense-nodes 2000   # smoke
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import cora, dense_sbm, measure, print_rows

from graphstore.layout import Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.lookup import completed_run
from graphstore.report import plot_accuracy_vs_bytes
from retexo_core.comm.network import NetworkModel

NETWORKS = {
    "datacenter": NetworkModel(latency_ms=0.1, bandwidth_mbps=10_000),
    "WAN": NetworkModel(latency_ms=20, bandwidth_mbps=100),
    "edge": NetworkModel(latency_ms=50, bandwidth_mbps=10),
}


def strategies(rounds: int) -> list[tuple[str, str, dict[str, object]]]:
    """(label, partition method, options)."""
    return [
        ("centralized", "random", {"strategy": "centralized", "epochs": rounds}),
        ("standard", "random", {"strategy": "standard", "epochs": rounds}),
        ("bns(0.1)", "random", {"strategy": "standard", "epochs": rounds, "bns_rate": 0.1}),
        ("varco(8->1)", "random", {"strategy": "varco", "epochs": rounds, "varco_c_max": 8, "varco_c_min": 1}),
        ("RandomTMA", "random", {"strategy": "tma", "epochs": rounds, "agg_every_steps": 10}),
        ("SuperTMA", "supernode", {"strategy": "tma", "epochs": rounds, "agg_every_steps": 10}),
        ("grappa", "random", {"strategy": "grappa", "epochs": rounds, "grappa_refresh_every": 50}),
        ("retexo(grad)", "random", {"strategy": "retexo", "rounds": rounds}),
        ("retexo(avg/5,int8)", "random", {"strategy": "retexo", "rounds": rounds, "sync": "avg", "sync_every": 5,
                                          "compress": "int8"}),
    ]


def compare(title: str, store: Store, dataset, parts: int, rounds: int, plot: Path) -> None:
    partitions = {method: build_partition(store, dataset, PartitionOptions(method=method, parts=parts, seed=0))
                  for method in ("random", "supernode")}
    rows = [measure(store, dataset, partitions[method], label, NETWORKS, model="gcn", **options)
            for label, method, options in strategies(rounds)]
    print_rows(title, rows, list(NETWORKS))
    runs = [completed_run(store, row["run"]).model_copy(update={"label": row["strategy"]}) for row in rows]
    plot.write_bytes(plot_accuracy_vs_bytes(runs, "", title))
    print(f"plot: {plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--dense-nodes", type=int, default=10_000)
    parser.add_argument("--dense-degree", type=float, default=100)
    parser.add_argument("--store", type=Path, default=None, help="reuse a store (finished runs are not redone)")
    parser.add_argument("--plot-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    args.plot_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="retexo-bench-") as tmp:
        store = Store.open(args.store or Path(tmp) / "store")
        compare(f"Cora, {args.parts} partitions, GCN, {args.rounds} rounds/epochs", store, cora(store), args.parts,
                args.rounds, args.plot_dir / "compare_cora.png")
        compare(f"SBM {args.dense_nodes} nodes, degree {args.dense_degree:g}, {args.parts} partitions, GCN", store,
                dense_sbm(store, args.dense_nodes, args.dense_degree), args.parts, args.rounds,
                args.plot_dir / "compare_dense.png")


if __name__ == "__main__":
    main()
