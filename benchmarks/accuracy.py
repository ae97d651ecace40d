"""Accuracy of the default recipe against the published Retexo table and plain PyG.

On Cora (bundled; the public Planetoid split) it trains, for GCN, GraphSAGE and GAT and for each
of ``--seeds`` training seeds: ``centralized`` (one process, end to end), ``retexo`` (4 workers),
``standard`` (4 workers, full-graph distributed) and a plain PyG model with the same recipe
(``benchmarks/pyg_reference.py``). Every run uses the options of ``retexo train`` by default
(METIS into 4 parts unless ``--partition-method`` says otherwise); only the seed changes. It
prints mean ± standard deviation of validation and test accuracy, the mean bytes sent and the
mean rounds (layer-wise, summed over layers) or epochs trained, next to the figures published in
the Retexo README for Cora. More graphs: ``--planetoid DIR`` (a Planetoid folder, e.g. CiteSeer)
and ``--synthetic NODES`` (the generator's defaults); they print without published figures.

    .venv/bin/python benchmarks/accuracy.py [--seeds 5] [--planetoid DIR] [--synthetic 20000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graphstore.ingest.api import ingest_planetoid, ingest_synthetic  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.synthetic import SyntheticOptions  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef  # noqa: E402
from graphstore.manifests import LayerManifest, read_manifest  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from pyg_reference import load_plain, pyg_reference  # noqa: E402
from retexo_core.comm.network import NetworkModel  # noqa: E402
from retexo_core.config import TrainConfig  # noqa: E402
from runner.lifecycle import run_training  # noqa: E402
from runner.plan import plan_run  # noqa: E402

MODELS = ("gcn", "sage", "gat")
STRATEGIES = ("centralized", "retexo", "standard")
# Retexo README (Cora, transductive): (centralized model, Retexo model)
PUBLISHED = {"gcn": (0.820, 0.828), "sage": (0.826, 0.825), "gat": (0.807, 0.818)}


def train_once(store: Store, dataset: DatasetRef, partition: object, strategy: str, model: str,
               seed: int) -> dict[str, float]:
    """One run with the defaults of ``retexo train`` (or its figures from the store)."""
    config = TrainConfig(strategy=strategy, model=model, seed=seed, timeout_s=1800)
    plan = plan_run(store, dataset, None if strategy == "centralized" else partition, config, NetworkModel())
    summary, _ = run_training(plan)
    run_dir = store.run_dir(plan.run_fp)
    trained = [read_manifest(run_dir / f"layer={l}", LayerManifest).rounds for l in plan.layers]
    rounds = sum(trained) if config.is_layerwise else trained[0]  # end to end: every layer records the epochs
    return {"val": summary.accuracy("val"), "test": summary.accuracy("test"), "mb": summary.total_bytes / 1e6,
            "rounds": rounds}


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def measure(store: Store, dataset: DatasetRef, partition: object, seeds: int) -> list[dict[str, object]]:
    rows = []
    plain = load_plain(dataset)
    for model in MODELS:
        for strategy in (*STRATEGIES, "plain PyG"):
            if strategy == "plain PyG":
                runs = [pyg_reference(plain, model, 256, 200, seed) | {"mb": 0.0} for seed in range(seeds)]
                runs = [r | {"val": r["val_acc"], "test": r["test_acc"]} for r in runs]
            else:
                runs = [train_once(store, dataset, partition, strategy, model, seed) for seed in range(seeds)]
            row = {"graph": dataset.name, "model": model, "strategy": strategy,
                   "val": spread([r["val"] for r in runs]), "test": spread([r["test"] for r in runs]),
                   "test_mean": statistics.mean(r["test"] for r in runs),
                   "mb": statistics.mean(r["mb"] for r in runs), "rounds": statistics.mean(r["rounds"] for r in runs)}
            print(f"  {dataset.name} {model} {strategy}: test {row['test']}", flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--store", type=Path, help="store to use (default: a temporary one)")
    parser.add_argument("--partition-method", default="metis", choices=("metis", "random"))
    parser.add_argument("--planetoid", type=Path, action="append", default=[], help="more Planetoid folders")
    parser.add_argument("--synthetic", type=int, action="append", default=[], help="more synthetic graphs (nodes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retexo-accuracy-") as tmp:
        store = Store.open(args.store or Path(tmp) / "store")
        graphs = [ingest_planetoid(store, REPO / "data" / "cora", "cora")]
        graphs += [ingest_planetoid(store, folder, folder.name.lower()) for folder in args.planetoid]
        graphs += [ingest_synthetic(store, f"sbm{n // 1000}k", SyntheticOptions(nodes=n, seed=0), SplitFractions(seed=0))
                   for n in args.synthetic]
        rows = []
        for dataset in graphs:
            partition = build_partition(store, dataset, PartitionOptions(method=args.partition_method, parts=4))
            print(f"{dataset.name}: {args.seeds} seeds, {args.partition_method} into 4 parts", flush=True)
            rows += measure(store, dataset, partition, args.seeds)

    print(f"\nmean ± std over {args.seeds} seeds; published: Retexo README, Cora (centralized model / Retexo)\n")
    print("| graph | model | strategy | val acc | test acc | published | MB sent | rounds (layer-wise, all layers) or epochs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        published = PUBLISHED[r["model"]] if r["graph"] == "cora" else None
        cell = "" if published is None else {"centralized": f"{published[0]:.3f}",
                                             "retexo": f"{published[1]:.3f}"}.get(r["strategy"], "")
        print(f"| {r['graph']} | {r['model']} | {r['strategy']} | {r['val']} | {r['test']} | {cell} | "
              f"{r['mb']:,.1f} | {r['rounds']:.0f} |")
    print("\nretexo − centralized (test, points): " + ", ".join(
        f"{g} {m} {100 * (by[(g, m, 'retexo')] - by[(g, m, 'centralized')]):+.1f}"
        for by in [{(r["graph"], r["model"], r["strategy"]): r["test_mean"] for r in rows}]
        for g, m in dict.fromkeys((r["graph"], r["model"]) for r in rows)))


if __name__ == "__main__":
    main()
