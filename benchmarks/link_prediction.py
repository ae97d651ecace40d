"""Link prediction on real graphs: the plain PyG reference (``examples/link_pred.py``'s recipe,
``benchmarks/pyg_link_reference.py``) against the project's ``centralized`` and ``retexo`` on the
same stored split (and ``standard``, full-graph training over the same METIS partition, and
RandomTMA / SuperTMA: ``tma`` over a random / supernode partition), per seed: test and validation ROC-AUC, MRR and Hits@K, bytes, training time.

Each seed draws its own split (``retexo ingest link-split --link-seed <seed>``: 5 % of the edges
for validation, 10 % for test, as many negatives, PyG's fractions), and every row of that seed is
scored on the same stored pairs. The reference trains on the split's training edges as arrays
(PyG scores its test pairs on the training edges plus the validation positives, as the example's
``RandomLinkSplit`` does); the project's runs train through the pipeline with their defaults
(``--recipe auto``), retexo on a METIS partition into ``--parts`` parts, their ranks as threads of
this process (the same bytes and results as processes). ``--graphs`` takes any graph of the
accuracy suite (``benchmarks/accuracy.py``: ``../shared/datasets``, ingested from its original
files) and SEAL's eight structure-only link-prediction graphs (``seal_linkpred``: ``retexo ingest
mat``, node i's feature the one-hot i); ``--what`` also takes ``retexo-screen<N>`` (the recipe
search with ``--recipe-screen N``), ``standard-default`` and ``tma-default`` (``--recipe default``:
the features alone).

    python benchmarks/link_prediction.py --graphs cora,citeseer --seeds 3
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from accuracy import SUITE, ingest
from common import REPO, mb  # noqa: F401 (puts the repository on the path)
from graphstore.ingest.api import ingest_mat
from graphstore.ingest.link_split import LinkSplitOptions, split_links
from graphstore.layout import LINK_PAIRS, Store
from graphstore.lookup import DatasetRef
from graphstore.parquet_io import features_of, read_table
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from pyg_link_reference import train_plain_link
from retexo_core.config import TrainConfig
from runner.lifecycle import LaunchOptions, run_training
from runner.request import RunRequest, prepare_run

METRICS = ("roc_auc", "mrr", "hits_at_k")
DATASETS = REPO.parent / "shared" / "datasets"
SUITE_GRAPHS = {graph.name: graph for graph in SUITE}
SEAL = ("USAir", "NS", "PB", "Yeast", "Celegans", "Power", "Router", "Ecoli")  # seal_linkpred/<name>.mat
GRAPHS = (*SUITE_GRAPHS, *(name.lower() for name in SEAL))


def source_graph(store: Store, graph: str) -> DatasetRef:
    """``graph`` ingested from its original files."""
    if graph in SUITE_GRAPHS:
        return ingest(store, SUITE_GRAPHS[graph], DATASETS)
    file = next(name for name in SEAL if name.lower() == graph)
    return ingest_mat(store, DATASETS / "seal_linkpred" / f"{file}.mat", graph)


def reference_row(dataset: DatasetRef, seed: int, hits_k: int) -> dict[str, Any]:
    """PyG's example recipe on the stored split of ``dataset``."""
    node_id = read_table(dataset.path / "nodes.parquet", columns=["node_id"]).column("node_id").to_numpy()
    x = features_of(read_table(dataset.path / "features.parquet"), dataset.num_features)
    x = np.asarray(x.todense() if hasattr(x, "todense") else x, np.float32)
    edges = read_table(dataset.path / "edges.parquet")
    train = np.stack([np.searchsorted(node_id, edges.column(c).to_numpy()) for c in ("src", "dst")])
    table = read_table(dataset.path / LINK_PAIRS)
    split = table.column("split").to_numpy(zero_copy_only=False)
    pairs = {}
    for name in ("val", "test"):
        rows = split == name
        pairs[name] = (np.searchsorted(node_id, table.column("src").to_numpy()[rows]),
                       np.searchsorted(node_id, table.column("dst").to_numpy()[rows]),
                       table.column("label").to_numpy()[rows].astype(np.int64))
    result = train_plain_link(x, train, pairs, seed=seed, hits_k=hits_k)
    return {"what": "plain PyG GCN (link_pred example)", "bytes": 0, "seconds": result.seconds,
            **{f"{s}_{m}": result.metrics[s][m] for s in ("val", "test") for m in METRICS}}


def pipeline_row(store: Store, dataset: DatasetRef, what: str, parts: int, hits_k: int, method: str = "metis",
                 **options: Any) -> dict[str, Any]:
    """One run of the pipeline (or its stored result), over a ``method`` partition."""
    config = TrainConfig(task="link", hits_k=hits_k, timeout_s=1800, **options)
    partition = None
    if not config.strategy_spec.whole_graph:
        partition = build_partition(store, dataset, PartitionOptions(method=method, parts=parts, seed=0))
    plan = prepare_run(RunRequest.over(store, dataset, partition, config), partitions="stored")
    started = time.perf_counter()
    summary, _ = run_training(plan, LaunchOptions(launcher="threads"))
    rows = {r["split"]: r for r in summary.evaluation}
    return {"what": what, "bytes": summary.total_bytes, "seconds": summary.wall_s or time.perf_counter() - started,
            **{f"{s}_{m}": float(rows[s][m]) for s in ("val", "test") for m in METRICS}}


def mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", default="cora,citeseer")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--hits-k", type=int, default=50)
    parser.add_argument("--what", default="reference,centralized,standard,tma,retexo,retexo-default")
    parser.add_argument("--store", default="/tmp/retexo-link-bench")
    args = parser.parse_args()
    unknown = sorted(set(args.graphs.split(",")) - set(GRAPHS))
    if unknown:
        parser.error(f"--graphs: unknown {', '.join(unknown)} (expected some of {', '.join(GRAPHS)})")
    store = Store.open(args.store)
    wanted = args.what.split(",")
    table: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for graph in args.graphs.split(","):
        source = source_graph(store, graph)
        for seed in range(args.seeds):
            dataset = split_links(store, source, f"{graph}_link{seed}", LinkSplitOptions(seed=seed))
            rows = []
            if "reference" in wanted:
                rows.append(reference_row(dataset, seed, args.hits_k))
            if "centralized" in wanted:
                rows.append(pipeline_row(store, dataset, "centralized", 1, args.hits_k, strategy="centralized", seed=seed))
            if "standard" in wanted:
                rows.append(pipeline_row(store, dataset, f"standard ({args.parts} parts)", args.parts, args.hits_k,
                                         strategy="standard", seed=seed))
            if "standard-default" in wanted:  # the features alone: one training instead of the search's
                rows.append(pipeline_row(store, dataset, f"standard --recipe default ({args.parts} parts)", args.parts,
                                         args.hits_k, strategy="standard", recipe="default", seed=seed))
            for what, recipe in (("tma", "auto"), ("tma-default", "default")):
                if what not in wanted:
                    continue
                flag = " --recipe default" if recipe == "default" else ""
                for method, name in (("random", "RandomTMA"), ("supernode", "SuperTMA")):
                    rows.append(pipeline_row(store, dataset, f"{name}{flag} ({args.parts} parts)", args.parts,
                                             args.hits_k, method=method, strategy="tma", recipe=recipe, seed=seed))
            if "retexo" in wanted:
                rows.append(pipeline_row(store, dataset, f"retexo ({args.parts} parts)", args.parts, args.hits_k,
                                         strategy="retexo", seed=seed))
            if "retexo-default" in wanted:  # no recipe search beyond the features: a third of the gradient sync
                rows.append(pipeline_row(store, dataset, f"retexo --recipe default ({args.parts} parts)", args.parts,
                                         args.hits_k, strategy="retexo", recipe="default", seed=seed))
            for what in wanted:
                if what.startswith("retexo-screen"):  # the search with fewer rounds per candidate
                    screen = int(what.removeprefix("retexo-screen"))
                    rows.append(pipeline_row(store, dataset, f"retexo --recipe-screen {screen} ({args.parts} parts)",
                                             args.parts, args.hits_k, strategy="retexo", recipe_screen=screen,
                                             seed=seed))
            for row in rows:
                print(f"  {graph} seed {seed} {row['what']}: test roc_auc {row['test_roc_auc']:.4f} mrr "
                      f"{row['test_mrr']:.4f} hits@{args.hits_k} {row['test_hits_at_k']:.4f} (val roc_auc "
                      f"{row['val_roc_auc']:.4f}), {mb(row['bytes'])} MB, {row['seconds']:.1f} s", flush=True)
                table.setdefault((graph, row["what"]), []).append(row)
    k = args.hits_k
    print(f"\n| graph | what | test ROC-AUC | test MRR | test Hits@{k} | val ROC-AUC | MB sent | training s | seeds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (graph, what), rows in table.items():
        cell = {key: mean_std([r[key] for r in rows]) for key in ("test_roc_auc", "test_mrr", "test_hits_at_k",
                                                                   "val_roc_auc")}
        print(f"| {graph} | {what} | {cell['test_roc_auc']} | {cell['test_mrr']} | {cell['test_hits_at_k']} | "
              f"{cell['val_roc_auc']} | {mb(np.mean([r['bytes'] for r in rows]))} | "
              f"{np.mean([r['seconds'] for r in rows]):.1f} | {len(rows)} |")


if __name__ == "__main__":
    main()
