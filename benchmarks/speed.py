"""Training speed against the plain PyG GCN a user would otherwise write, on the CPU or a GPU,
measured in one run.

For Cora (bundled, METIS into 4 parts) and a synthetic graph (``--large-nodes``, default 200,000
nodes; average degree 20, 64 features, METIS into ``--large-parts``; ``--large-nodes 1000000
--large-parts 8`` is the 1M-node, 20M-edge graph of docs/scale.md) it runs the ``retexo train``
command (a subprocess, as a user runs it) for each of ``--what`` (retexo with K workers,
centralized, centralized layer-wise, standard with K workers), and a plain PyG GCN written here
(``benchmarks/pyg_reference.py``: 2 layers, full batch, one process, ``GCNConv(cached=True)``,
validation every epoch as in PyG's example) on the same device.

``--device cuda`` trains everything on the GPU (the workers of a multi-worker run share it);
``--cpu-too`` runs the same rows on the CPU as well, in one run, so that every time has a ratio
to the same code on the CPU. Each device trains in a store of its own (the datasets and
partitions are hard links of the first one's): the device is in no fingerprint, so one store
would reuse the first device's runs.

It prints one table: the wall time of the whole command, the training seconds inside the
workers (the run manifest's ``wall_s``: every layer from its halo exchange to its commit),
milliseconds per round over those seconds (layer-wise: per round of one layer; end to end: per
epoch) and over the round loops alone (rank 0's log: validation included, the layer's halo
exchange, aggregation, outputs and commit not), test accuracy and the peak GPU memory a rank
allocated; the round loop's ms as ratios to PyG's epoch on the same device (its loop, validation
every epoch) and to the same row on the CPU. The project's runs train the configured recipe (``--recipe default``): this measures what
a round costs, not the recipe search.

    .venv/bin/python benchmarks/speed.py [--skip-large] [--large-epochs 50]
    python benchmarks/speed.py --device cuda --cpu-too --skip-large --what retexo,centralized   # docs/gpus.md, Cora
    python benchmarks/speed.py --device cuda --cpu-too --skip-cora --what retexo,centralized --large-nodes 1000000 \\
        --large-parts 8 --large-hidden 256 --large-epochs 200 --cpu-large-rounds 10 --cpu-large-epochs 4   # and 1M

On the large graph the layer-wise runs train the default 200 rounds per layer and the end-to-end
ones (and PyG) ``--large-epochs`` epochs; on the CPU of a GPU run, ``--cpu-large-rounds`` and
``--cpu-large-epochs`` (when given) shorten them so that the run stays within minutes: ms per
round / epoch stay comparable (the layer's one-off halo exchange then weighs more on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from graphstore.ingest.api import ingest_planetoid, ingest_synthetic  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.synthetic import SyntheticOptions  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef, find_dataset  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from pyg_reference import load_plain, pyg_reference  # noqa: E402

RETEXO = [sys.executable, "-m", "cli"]
WHAT = {
    "retexo": ("retexo ({k} workers)", ["--strategy", "retexo"], True),
    "centralized": ("centralized", ["--strategy", "centralized"], False),
    "layerwise": ("centralized layer-wise", ["--strategy", "centralized", "--layerwise"], False),
    "standard": ("standard ({k} workers)", ["--strategy", "standard"], True),
}
PEAK = re.compile(r"peak GPU memory ([0-9.]+) GB")
LOOP = re.compile(r"(\d+) (?:rounds|epochs) in ([0-9.]+) s")


@dataclass(frozen=True)
class Graph:
    """One benchmark graph: its name in the table, the dataset, K and the rounds / epochs per device."""

    name: str
    dataset: str
    parts: int
    hidden: int
    rounds: dict[str, int]
    epochs: dict[str, int]


def peak_gpu_gb(run: Path) -> float | None:
    """The largest peak GPU memory (GB) any rank of ``run`` logged, None on the CPU."""
    peaks = [float(m) for log in run.glob("logs/rank-*.log") for m in PEAK.findall(log.read_text())]
    return max(peaks) if peaks else None


def loop_ms(run: Path) -> float:
    """Milliseconds per round of rank 0's round (or epoch) loops, validation included (its log)."""
    loops = [(int(n), float(s)) for n, s in LOOP.findall((run / "logs" / "rank-0.log").read_text())]
    return 1000 * sum(s for _, s in loops) / max(sum(n for n, _ in loops), 1)


def retexo_train(store: Path, dataset: str, args: list[str]) -> dict[str, float | None]:
    """The whole ``retexo train`` command; training seconds and accuracy from the run's manifest."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    result = subprocess.run([*RETEXO, "train", dataset, *args, "--store", str(store)], cwd=REPO, env=env,
                            capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"retexo train {' '.join(args)} failed:\n{result.stderr}")
    run = max(store.glob("runs/run=*/manifest.json"), key=lambda p: p.stat().st_mtime).parent
    manifest = json.loads((run / "manifest.json").read_text())
    config = manifest["config"]
    layerwise = config["strategy"] == "retexo" or config.get("layerwise")
    rounds = (sum(config["rounds"]) if isinstance(config["rounds"], list) else config["rounds"] * config["layers"]) \
        if layerwise else config["epochs"]
    return {"wall_s": wall, "train_s": manifest["wall_s"], "rounds": rounds, "test_acc": manifest["test_acc"],
            "gpu_gb": peak_gpu_gb(run), "loop_ms": loop_ms(run)}


def measure(store: Path, graph: Graph, device: str, whats: list[str]) -> list[tuple[str, dict]]:
    """The PyG reference and each of ``whats`` on ``graph``, on ``device``."""
    rounds, epochs = graph.rounds[device], graph.epochs[device]
    dataset = find_dataset(Store.open(store), graph.dataset)
    plain = pyg_reference(load_plain(dataset), "gcn", graph.hidden, epochs, device=device)
    rows = [("plain PyG GCN (1 process)", {**plain, "loop_ms": 1000 * plain["train_s"] / epochs})]  # its loop only
    done(graph, device, *rows[-1])
    # the greedy layers' round loops (without the last two layers together, whose rounds run end to end)
    common = ["--hidden", str(graph.hidden), "--rounds", str(rounds), "--epochs", str(epochs), "--recipe", "default",
              "--joint-rounds", "0", "--device", device]
    for what in whats:
        label, extra, partitioned = WHAT[what]
        partition = ["--partition-method", "metis", "--parts", str(graph.parts)] if partitioned else []
        rows.append((label.format(k=graph.parts), retexo_train(store, graph.dataset, [*common, *extra, *partition])))
        done(graph, device, *rows[-1])
    return rows


def done(graph: Graph, device: str, label: str, row: dict) -> None:
    """One line per finished run, so that an interrupted benchmark still shows what it measured."""
    print(f"  {graph.name} on {device}: {label}: training {row['train_s']:.1f} s, round loop {row['loop_ms']:.1f} ms "
          f"per round, test {row['test_acc']:.3f}", flush=True)


def linked_store(source: Path, target: Path) -> Path:
    """A second store holding ``source``'s datasets and partitions as hard links (no runs)."""
    for folder in ("datasets", "partitions"):
        shutil.copytree(source / folder, target / folder, copy_function=os.link)
    return target


def print_table(results: dict[tuple[str, str], list[tuple[str, dict]]]) -> None:
    """One row per run: times, and the round loop's ms per round as ratios to PyG's epoch on the
    same device and to the same row on the CPU."""
    print("\n| graph | device | what | command wall s | training s | ms per round (whole layers) "
          "| ms per round (round loop) | x PyG epoch (same device) | x CPU | test acc | peak GPU memory per rank (GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (graph, device), rows in results.items():
        reference = rows[0][1]["loop_ms"]
        cpu = dict(results.get((graph, "cpu"), []))
        for label, r in rows:
            on_cpu = cpu.get(label)
            versus_cpu = f"{r['loop_ms'] / on_cpu['loop_ms']:.3f}" if on_cpu and device != "cpu" else ""
            gpu = f"{r['gpu_gb']:.2f}" if r.get("gpu_gb") is not None else ""
            print(f"| {graph} | {device} | {label} | {r['wall_s']:.1f} | {r['train_s']:.1f} | "
                  f"{1000 * r['train_s'] / r['rounds']:.1f} | {r['loop_ms']:.1f} | {r['loop_ms'] / reference:.2f} | "
                  f"{versus_cpu} | {r['test_acc']:.3f} | {gpu} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="store to use (default: a temporary one)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where everything trains")
    parser.add_argument("--cpu-too", action="store_true", help="also run every row on the CPU (with --device cuda)")
    parser.add_argument("--what", default="retexo,centralized,layerwise,standard",
                        help=f"the project's runs, comma list of {', '.join(WHAT)}")
    parser.add_argument("--skip-large", action="store_true", help="Cora only")
    parser.add_argument("--skip-cora", action="store_true", help="the large graph only")
    parser.add_argument("--large-nodes", type=int, default=200_000, help="nodes of the synthetic graph")
    parser.add_argument("--large-parts", type=int, default=4, help="METIS parts (workers) of the synthetic graph")
    parser.add_argument("--large-hidden", type=int, default=128, help="hidden size on the synthetic graph")
    parser.add_argument("--large-epochs", type=int, default=50, help="epochs of the end-to-end runs on the large graph")
    parser.add_argument("--cpu-large-rounds", type=int, help="rounds per layer on the large graph, CPU of a GPU run")
    parser.add_argument("--cpu-large-epochs", type=int, help="epochs on the large graph, CPU of a GPU run")
    args = parser.parse_args()
    whats = args.what.split(",")
    devices = [args.device] + (["cpu"] if args.cpu_too and args.device != "cpu" else [])
    with tempfile.TemporaryDirectory(prefix="retexo-speed-") as tmp:
        root = args.store or Path(tmp) / "store"
        store = Store.open(root)
        graphs = []
        if not args.skip_cora:
            cora: DatasetRef = ingest_planetoid(store, REPO / "data" / "cora", "cora")
            build_partition(store, cora, PartitionOptions(method="metis", parts=4))
            graphs.append(Graph("Cora", "cora", 4, 256, dict.fromkeys(devices, 200), dict.fromkeys(devices, 200)))
        if not args.skip_large:
            name = f"sbm{args.large_nodes // 1000}k"
            big = ingest_synthetic(store, name, SyntheticOptions(nodes=args.large_nodes, avg_degree=20, classes=10,
                                                                 features=64, seed=0), SplitFractions(seed=0))
            build_partition(store, big, PartitionOptions(method="metis", parts=args.large_parts))
            rounds = {d: 200 for d in devices}
            epochs = {d: args.large_epochs for d in devices}
            if args.device != "cpu":
                rounds["cpu"] = args.cpu_large_rounds or 200
                epochs["cpu"] = args.cpu_large_epochs or args.large_epochs
            graphs.append(Graph(f"SBM {args.large_nodes // 1000}k", name, args.large_parts, args.large_hidden, rounds,
                                epochs))
        stores = {args.device: root}
        for device in devices[1:]:
            stores[device] = linked_store(root, Path(tmp) / f"store-{device}")
        results = {}
        for graph in graphs:
            for device in devices:
                print(f"{graph.name} on {device}: hidden {graph.hidden}, {graph.rounds[device]} rounds per layer, "
                      f"{graph.epochs[device]} epochs", flush=True)
                results[(graph.name, device)] = measure(stores[device], graph, device, whats)
        print_table(results)


if __name__ == "__main__":
    main()
