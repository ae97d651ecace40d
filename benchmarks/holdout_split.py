"""The suite's small graphs under the protocol of the graphs we are checked on: a stratified
60/20/20 split drawn at ingest, where the suite uses the graphs' own splits.

The graphs we are checked on (issue 26) were measured with a 60/20/20 stratified split (seed 0)
drawn by ingest, 4 random parts, ``retexo train``'s defaults. The suite trains Cora and CiteSeer
on their public split (fewer than 10 % of the nodes train, which switches the fresh pair on) and
chameleon_filtered on its official splits. This script ingests each graph from its original
file as ``retexo ingest npz --draw-split`` does (the file's masks ignored, a stratified split
drawn: 60/20/20, seed 0; a Planetoid folder is first written, read with the project's loader, to
an ``.npz`` without masks in a temporary folder), cuts it into 4 random parts (seed 0;
``--partition metis`` cuts it by METIS) and trains the variants of ``accuracy.py`` (by default
the four the checks compare) for training seeds ``0..N-1`` on that one split. The reference reads
the features as the file gives them: for a graph read from tables or an ``.npz``, PyG's examples
normalise nothing.

Each (graph, model, variant, seed) runs as one process of a pool of ``--jobs``, one torch thread
each; ``--out`` keeps the rows in ``accuracy.py --out``'s format after every run, so
``accuracy.py --tables FILE`` prints the tables and the checks again.

    .venv/bin/python benchmarks/holdout_split.py [--graphs cora,citeseer,chameleon_filtered] [--models gcn,sage,gat]
        [--seeds 3] [--partition random|metis] [--jobs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accuracy import (ALL_VARIANTS, MODELS, REPO, SUITE, SUITE_PARTS, in_suite_order, merged, print_tables,
                      reference_once, train_once)
from graphstore.ingest import planetoid
from graphstore.ingest.api import ingest_npz
from graphstore.ingest.splits import SplitFractions
from graphstore.layout import Store
from graphstore.lookup import DatasetRef
from graphstore.partition.build import build_partition
from pyg_reference import load_plain
from runner.launcher_watch import die_with_parent_thread

FRACTIONS = SplitFractions(train=0.6, val=0.2, seed=0)
CHECKED = ("reference", "centralized", "retexo", "retexo avg/5 int8")


def planetoid_npz(folder: Path, out: Path) -> Path:
    """A Planetoid folder's nodes (rows 0..N-1), features, labels and edges as an ``.npz`` without
    split masks at ``out``, so that ``retexo ingest npz`` draws a split for it."""
    loaded = planetoid.load_planetoid(folder)
    if not np.array_equal(loaded.node_id, np.arange(len(loaded.node_id))):
        raise ValueError(f"{folder}: expected node ids 0..N-1")
    np.savez(out, node_features=loaded.x.toarray().astype(np.float32), node_labels=loaded.label,
             edges=np.stack([loaded.src, loaded.dst], axis=1))
    return out


def resplit(store: Store, datasets: Path, graph: str, folder: Path) -> DatasetRef:
    """``graph`` ingested with a stratified 60/20/20 split (seed 0), as ``retexo ingest npz --draw-split``
    ingests it (a Planetoid graph: from ``planetoid_npz``)."""
    source = datasets / {g.name: g.path for g in SUITE}[graph]
    if source.is_dir():
        source = planetoid_npz(source, folder / f"{graph}.npz")
    return ingest_npz(store, source, f"{graph}_602020", fractions=FRACTIONS, draw_split=True)


def one_run(store_path: Path, dataset: DatasetRef, partition: object, graph: str, model: str, variant: str,
            seed: int) -> dict[str, Any]:
    """One variant's run (a pool process, one torch thread): validation, test, MB and seconds."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    options = ALL_VARIANTS[variant]
    run = (reference_once(load_plain(dataset), model, seed) if options is None
           else train_once(Store.open(store_path), dataset, partition, options, model, seed))
    return {"graph": graph, "model": model, "variant": variant, "seed": seed, **run,
            "seconds": time.perf_counter() - started}


def as_rows(runs: list[dict[str, Any]], metric: dict[str, str]) -> list[dict[str, Any]]:
    """Per-seed runs as ``accuracy.py --out`` rows (one per graph, model and variant, seeds in order)."""
    rows = [{"graph": r["graph"], "model": r["model"], "variant": r["variant"], "seeds": 1,
             "metric": metric[r["graph"]], "device": "cpu", "val": [r["val"]], "test": [r["test"]], "mb": r["mb"],
             "seconds": r["seconds"]} for r in sorted(runs, key=lambda r: r["seed"])]
    return in_suite_order(merged(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", type=Path, default=REPO.parent / "shared" / "datasets")
    parser.add_argument("--graphs", default="cora,citeseer,chameleon_filtered")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(CHECKED), help="comma list of: " + ", ".join(ALL_VARIANTS))
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1, on the one split")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--partition", default="random", choices=["random", "metis"],
                        help="how the 4 parts are cut (seed 0); the suite's cut is random")
    parser.add_argument("--store", type=Path, help="store to use (default: a temporary one); runs in it are reused")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here (accuracy.py --tables reads it)")
    args = parser.parse_args()
    graphs, models, variants = args.graphs.split(","), args.models.split(","), args.variants.split(",")
    if unknown := [g for g in graphs if g not in {s.name for s in SUITE}]:
        parser.error(f"--graphs: unknown {', '.join(unknown)}; expected some of: {', '.join(s.name for s in SUITE)}")
    if unknown := [v for v in variants if v not in ALL_VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected some of: {', '.join(ALL_VARIANTS)}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="retexo-holdout-") as tmp:
        store_path = args.store or Path(tmp) / "store"
        store = Store.open(store_path)
        inputs, metric = {}, {}
        parts = SUITE_PARTS.model_copy(update={"method": args.partition})
        for graph in graphs:
            dataset = resplit(store, args.datasets, graph, Path(tmp))
            inputs[graph] = (dataset, build_partition(store, dataset, parts))
            metric[graph] = "ROC-AUC" if dataset.num_classes == 2 else "accuracy"
        jobs = [(g, m, v, s) for s in range(args.seeds) for m in models for g in graphs for v in variants]
        runs: list[dict[str, Any]] = []
        with ProcessPoolExecutor(max_workers=args.jobs, initializer=die_with_parent_thread) as pool:
            futures = [pool.submit(one_run, store_path, *inputs[g], g, m, v, s) for g, m, v, s in jobs]
            for future in as_completed(futures):
                run = future.result()
                runs.append(run)
                print(f"  {run['graph']} {run['model']} {run['variant']} seed {run['seed']}: val {run['val']:.3f} "
                      f"test {run['test']:.3f} ({run['seconds']:.0f} s)", flush=True)
                if args.out:
                    args.out.write_text(json.dumps(as_rows(runs, metric), indent=1))
    rows = as_rows(runs, metric)
    print_tables(rows)
    print(f"\n{time.perf_counter() - started:.0f} s in all ({statistics.fmean(r['seconds'] for r in runs):.0f} s a run)")


if __name__ == "__main__":
    main()
