"""Accuracy against bytes on the network: retexo vs standard vs BNS-GCN vs centralized.

Cora (4 random partitions) and a dense synthetic SBM (average degree >= 100), GCN / SAGE / GAT,
2 layers, hidden 256. Prints, per graph and model, test accuracy, bytes by kind, total bytes and
simulated communication time at 100 Mbit/s + 10 ms, then the ratio of standard to retexo bytes.

    .venv/bin/python benchmarks/comm_accuracy.py                 # the full measurement
    .venv/bin/python benchmarks/comm_accuracy.py --rounds 5 --dense-nodes 2000 --models gcn   # smoke
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import cora, dense_sbm, measure, print_rows

from graphstore.layout import Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from retexo_core.comm.network import NetworkModel

NETWORKS = {"100Mbit+10ms": NetworkModel(latency_ms=10, bandwidth_mbps=100)}


def strategies(rounds: int) -> list[tuple[str, dict[str, object]]]:
    return [
        ("centralized", {"strategy": "centralized", "epochs": rounds}),
        ("standard", {"strategy": "standard", "epochs": rounds}),
        ("bns(0.1)", {"strategy": "standard", "epochs": rounds, "bns_rate": 0.1}),
        ("retexo", {"strategy": "retexo", "rounds": rounds}),
    ]


def compare(title: str, store: Store, dataset, parts: int, models: list[str], rounds: int) -> None:
    partition = build_partition(store, dataset, PartitionOptions(method="random", parts=parts, seed=0))
    rows = [measure(store, dataset, partition, label, NETWORKS, model=model, **options)
            for model in models for label, options in strategies(rounds)]
    print_rows(title, rows, list(NETWORKS))
    for model in models:
        by = {r["strategy"]: r for r in rows if r["model"] == model}
        ratio = by["standard"]["total"] / max(by["retexo"]["total"], 1)
        gap = by["retexo"]["test_acc"] - by["centralized"]["test_acc"]
        print(f"{model}: standard/retexo bytes = {ratio:.1f}x; retexo - centralized test accuracy = {gap * 100:+.1f} points")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="rounds per layer (retexo) = epochs (others)")
    parser.add_argument("--models", default="gcn,sage,gat")
    parser.add_argument("--dense-models", default=None, help="models on the dense graph (default: --models)")
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--dense-nodes", type=int, default=10_000)
    parser.add_argument("--dense-degree", type=float, default=100)
    parser.add_argument("--store", type=Path, default=None, help="reuse a store (finished runs are not redone)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retexo-bench-") as tmp:
        store = Store.open(args.store or Path(tmp) / "store")
        models = args.models.split(",")
        compare(f"Cora, {args.parts} random partitions, 2 layers, hidden 256, {args.rounds} rounds/epochs",
                store, cora(store), args.parts, models, args.rounds)
        dense_models = args.dense_models.split(",") if args.dense_models else models
        compare(f"Synthetic SBM, {args.dense_nodes} nodes, average degree {args.dense_degree:g}, {args.parts} random "
                f"partitions", store, dense_sbm(store, args.dense_nodes, args.dense_degree), args.parts, dense_models,
                args.rounds)


if __name__ == "__main__":
    main()
