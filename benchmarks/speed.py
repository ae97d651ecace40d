"""Training speed against the plain PyG GCN a user would otherwise write, measured in one run.

For Cora (bundled) and a synthetic graph (200,000 nodes, average degree 20, 64 features; METIS
into 4 parts), it runs the ``retexo train`` command (a subprocess, as a user runs it) for retexo
(4 workers), centralized, centralized layer-wise and standard, and a plain PyG GCN written here
(``benchmarks/pyg_reference.py``: 2 layers, full batch, one process, ``GCNConv(cached=True)``,
validation every epoch as in PyG's example). It prints one table: the wall time of the whole command, the training seconds
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


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from graphstore.ingest.api import ingest_planetoid, ingest_synthetic  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.synthetic import SyntheticOptions  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from pyg_reference import load_plain, pyg_reference  # noqa: E402

RETEXO = [sys.executable, "-m", "cli"]


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
    rows = [("plain PyG GCN (1 process)", pyg_reference(load_plain(dataset), "gcn", hidden, epochs))]
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
