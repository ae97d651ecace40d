"""Training speed against the plain PyG GCN a user would otherwise write, measured in one run.

For Cora (bundled) and a synthetic graph (200,000 nodes, average degree 20, 64 features; METIS
into 4 parts), it runs the ``retexo train`` command (a subprocess, as a user runs it) for retexo
(4 workers), centralized, centralized layer-wise and standard, and a plain PyG GCN written here
(2 layers, full batch, one process, PyG's ``GCNConv(cached=True)``, validation every epoch as in
PyG's example). It prints one table: the wall time of the whole command, the training seconds
inside the workers, milliseconds per round (layer-wise: per round of one layer; end to end: per
epoch), test accuracy, and every time as a ratio to the PyG reference of the same graph.

    .venv/bin/python benchmarks/speed.py [--skip-large] [--large-epochs 50]

On the large graph the layer-wise runs train the default 200 rounds per layer and the end-to-end
ones (and PyG) ``--large-epochs`` epochs, so that the benchmark stays within minutes; ms per
round / epoch are comparable either way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graphstore.ingest.api import ingest_planetoid, ingest_synthetic  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.synthetic import SyntheticOptions  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef  # noqa: E402
from graphstore.parquet_io import features_of  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402

RETEXO = [sys.executable, "-m", "flows.cli"]


def pyg_reference(dataset: DatasetRef, hidden: int, epochs: int) -> dict[str, float]:
    """Plain PyG: two GCNConv layers, dense features, full batch, Adam, best validation epoch."""
    from torch_geometric.nn import GCNConv

    nodes = pq.read_table(dataset.path / "nodes.parquet", columns=["label", "split"])
    features = pq.read_table(dataset.path / "features.parquet")
    x = features_of(features, dataset.num_features)
    x = torch.from_numpy(x.toarray() if hasattr(x, "toarray") else x).float()
    edges = pq.read_table(dataset.path / "edges.parquet")
    edge_index = torch.from_numpy(np.stack([edges.column("src").to_numpy(), edges.column("dst").to_numpy()]))
    y = torch.from_numpy(nodes.column("label").to_numpy())
    split = nodes.column("split").to_numpy(zero_copy_only=False)
    masks = {s: torch.from_numpy(split == s) for s in ("train", "val", "test")}

    class GCN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = GCNConv(x.shape[1], hidden, cached=True)
            self.conv2 = GCNConv(hidden, dataset.num_classes, cached=True)

        def forward(self) -> torch.Tensor:
            h = F.dropout(x, 0.5, self.training)
            h = F.relu(self.conv1(h, edge_index))
            return self.conv2(F.dropout(h, 0.5, self.training), edge_index)

    torch.manual_seed(0)
    model = GCN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    best_val, test_at_best = -1.0, 0.0
    started = time.perf_counter()
    for _ in range(epochs):
        model.train()
        optimizer.zero_grad()
        F.cross_entropy(model()[masks["train"]], y[masks["train"]]).backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            pred = model().argmax(1)
        val = float((pred[masks["val"]] == y[masks["val"]]).float().mean())
        if val > best_val:
            best_val, test_at_best = val, float((pred[masks["test"]] == y[masks["test"]]).float().mean())
    seconds = time.perf_counter() - started
    return {"wall_s": seconds, "train_s": seconds, "rounds": epochs, "test_acc": test_at_best}


def retexo_train(store: Path, dataset: str, args: list[str]) -> dict[str, float]:
    """The whole ``retexo train`` command; training seconds and accuracy from the run's manifest."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    result = subprocess.run([*RETEXO, "train", dataset, *args, "--store", str(store)], cwd=REPO, env=env,
                            capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"retexo train {' '.join(args)} failed:\n{result.stderr}")
    newest = max(store.glob("runs/run=*/manifest.json"), key=lambda p: p.stat().st_mtime)
    manifest = json.loads(newest.read_text())
    config = manifest["config"]
    layerwise = config["strategy"] == "retexo" or config.get("layerwise")
    rounds = (sum(config["rounds"]) if isinstance(config["rounds"], list) else config["rounds"] * config["layers"]) \
        if layerwise else config["epochs"]
    return {"wall_s": wall, "train_s": manifest["wall_s"], "rounds": rounds, "test_acc": manifest["test_acc"]}


def measure_graph(store: Path, dataset: DatasetRef, hidden: int, rounds: int,
                  epochs: int) -> list[tuple[str, dict[str, float]]]:
    common = ["--hidden", str(hidden), "--rounds", str(rounds), "--epochs", str(epochs)]
    partition = ["--partition-method", "metis", "--parts", "4"]
    rows = [("plain PyG GCN (1 process)", pyg_reference(dataset, hidden, epochs))]
    for label, extra in (
        ("retexo (4 workers)", ["--strategy", "retexo", *partition]),
        ("centralized", ["--strategy", "centralized"]),
        ("centralized layer-wise", ["--strategy", "centralized", "--layerwise"]),
        ("standard (4 workers)", ["--strategy", "standard", *partition]),
    ):
        rows.append((label, retexo_train(store, dataset.name, [*common, *extra])))
        print(f"  {dataset.name}: {label} done", flush=True)
    return rows


def print_table(graph: str, rows: list[tuple[str, dict[str, float]]]) -> None:
    reference = rows[0][1]
    ref_ms = 1000 * reference["train_s"] / reference["rounds"]
    for label, r in rows:
        ms = 1000 * r["train_s"] / r["rounds"]
        print(f"| {graph} | {label} | {r['wall_s']:.1f} | {r['wall_s'] / reference['train_s']:.2f} | "
              f"{r['train_s']:.1f} | {r['train_s'] / reference['train_s']:.2f} | {ms:.1f} | {ms / ref_ms:.2f} | "
              f"{r['test_acc']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="store to use (default: a temporary one)")
    parser.add_argument("--skip-large", action="store_true", help="Cora only")
    parser.add_argument("--large-epochs", type=int, default=50, help="epochs of the end-to-end runs on the 200k graph")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retexo-speed-") as tmp:
        root = args.store or Path(tmp) / "store"
        store = Store.open(root)
        graphs = [("Cora", ingest_planetoid(store, REPO / "data" / "cora", "cora"), 256, 200, 200)]
        if not args.skip_large:
            big = ingest_synthetic(store, "sbm200k", SyntheticOptions(nodes=200_000, avg_degree=20, classes=10,
                                                                     features=64, seed=0), SplitFractions(seed=0))
            graphs.append(("SBM 200k", big, 128, 200, args.large_epochs))
        tables = []
        for name, dataset, hidden, rounds, epochs in graphs:
            build_partition(store, dataset, PartitionOptions(method="metis", parts=4))
            print(f"{name}: hidden {hidden}, {rounds} rounds per layer, {epochs} epochs", flush=True)
            tables.append((name, measure_graph(root, dataset, hidden, rounds, epochs)))
        print("\n| graph | what | command wall s | x PyG | training s | x PyG | ms per round | x PyG | test acc |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, rows in tables:
            print_table(name, rows)


if __name__ == "__main__":
    main()
