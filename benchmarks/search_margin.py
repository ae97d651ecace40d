"""The recipe search's margin (``--recipe-margin``), judged on validation nodes the search never saw.

A margin can only lower the validation score of the recipe it keeps (that score is what the
strict search maximises), so it cannot be judged on the validation split it searched. Nor may it be
judged on test. So each suite graph's validation split is cut in two, by a hash of the node id:
the search and the early stopping see half A as their validation split, and half B stands in for
the test split (the real test nodes become unlabelled: no test label is read). The run's "test"
figure is then its score on half B, a validation figure that no choice was made on.

For each graph, model and margin: ``centralized --layerwise`` (the layer-wise search, one rank:
retexo searches the same way, on 4), cut into 4 random parts (seed 0), the suite's seeds
(``benchmarks/accuracy.py``: ten training seeds on Cora and CiteSeer, the ten official splits of
chameleon_filtered and wisconsin), ranks as threads. It prints each margin's half-A and half-B
means and the paired gap of half B against margin 0, ± its standard error over the seeds.

The split of validation happens where each rank loads its partition (``retexo_core.data``), so the
runs go to a store of their own (``--store``, default a temporary one): they would share the
fingerprints of runs on the whole validation split.

    .venv/bin/python benchmarks/search_margin.py [--graphs cora,citeseer] [--models gcn] [--margins 0,1]
        [--seeds N] [--jobs N]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy  # noqa: E402
import retexo_core.data  # noqa: E402
from retexo_core.data import PartData  # noqa: E402
from runner.launcher_watch import die_with_parent_thread  # noqa: E402


def in_half_b(node_id: np.ndarray) -> torch.Tensor:
    """(n,) bool: the nodes of half B, by a multiplicative hash of their global ids (about half)."""
    ids = torch.from_numpy(np.array(node_id, dtype=np.int64))
    return ((ids * 2654435761) % 1000003) % 2 == 1


def nested(data: PartData) -> PartData:
    """``data`` with validation half A as its val split and half B as its test split."""
    val, half_b = data.masks["val"], in_half_b(data.node_id)
    return dataclasses.replace(data, masks={**data.masks, "val": val & ~half_b, "test": val & half_b})


def half_a_only(data: PartData) -> PartData:
    """``data`` with validation half A as its val split; half B unlabelled, the test split as it is."""
    val = data.masks["val"] & ~in_half_b(data.node_id)
    return dataclasses.replace(data, masks={**data.masks, "val": val})


# how a job sees the validation split: halves (A validates, B stands in for test), half-a (A
# validates, the real test split tests: what the choices lose with half the validation), whole
VALIDATION = {"halves": nested, "half-a": half_a_only, "whole": None}


def split_validation_on_load(split: Callable[[PartData], PartData]) -> None:
    """Every partition (and whole graph) a rank loads from now on comes with its masks as ``split`` sets them."""
    load_part, load_whole_graph = retexo_core.data.load_part, retexo_core.data.load_whole_graph
    retexo_core.data.load_part = lambda *a, **k: split(load_part(*a, **k))  # type: ignore[assignment]
    retexo_core.data.load_whole_graph = lambda *a, **k: split(load_whole_graph(*a, **k))  # type: ignore[assignment]


Runs = dict[float, dict[int, tuple[float, float]]]  # margin -> seed -> (half-A score, half-B score)


def start_worker(validation: str = "halves") -> None:
    """A job process: ends with the benchmark that spawned it (a stopped measurement leaves no
    worker training on), one torch thread, and validation split as ``VALIDATION[validation]`` sets
    it (default: in two) wherever it loads a partition."""
    die_with_parent_thread()
    torch.set_num_threads(1)
    if (split := VALIDATION[validation]) is not None:
        split_validation_on_load(split)


def one_run(store_path: Path, graph: accuracy.SuiteGraph, datasets: Path, model: str, margin: float,
            seed: int) -> tuple[str, str, float, int, float, float]:
    """One ``centralized --layerwise`` run: (graph, model, margin, seed, half-A score, half-B score)."""
    store = accuracy.Store.open(store_path)
    dataset, partition = accuracy.suite_partition(store, graph, datasets, seed)
    options: dict[str, Any] = {**accuracy.VARIANTS["centralized --layerwise"], "recipe_margin": margin}
    run = accuracy.train_once(store, dataset, partition, options, model, seed)
    return graph.name, model, margin, seed, run["val"], run["test"]


def measure(store_path: Path, graphs: list[accuracy.SuiteGraph], datasets: Path, models: list[str],
            margins: list[float], seeds: int | None, jobs: int) -> dict[tuple[str, str], Runs]:
    """(graph, model) -> its runs, every (graph, model, margin, seed) as a job of ``jobs`` processes
    side by side; each run's line is printed as it ends."""
    accuracy.prepare_suite(accuracy.Store.open(store_path), graphs, datasets, seeds, 0)
    tasks = [(g, m, margin, s) for g in graphs for m in models for s in range(g.seeds(seeds)) for margin in margins]
    out: dict[tuple[str, str], Runs] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=start_worker) as pool:
        futures = [pool.submit(one_run, store_path, g, datasets, m, margin, s) for g, m, margin, s in tasks]
        for future in as_completed(futures):
            name, model, margin, seed, half_a, half_b = future.result()
            out.setdefault((name, model), {m: {} for m in margins})[margin][seed] = (half_a, half_b)
            print(f"{name} {model} seed {seed} margin {margin:g}: half A {half_a:.4f}, half B {half_b:.4f}",
                  flush=True)
    return out


def gap(values: list[float], base: list[float]) -> str:
    """Paired mean gap in points ± its standard error over the seeds (``accuracy.paired_gap``)."""
    mean, error = accuracy.paired_gap(values, base)
    return f"{mean:+.2f}" + ("" if error is None else f" ± {error:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", type=Path, default=accuracy.REPO.parent / "shared" / "datasets")
    parser.add_argument("--graphs", default="cora,citeseer,wisconsin,chameleon_filtered")
    parser.add_argument("--models", default="gcn")
    parser.add_argument("--margins", default="0,1", help="comma list; the first is the baseline of the gaps")
    parser.add_argument("--seeds", type=int, help="seeds of every graph (default: the suite's own)")
    parser.add_argument("--store", type=Path, help="a store for these runs only (default: a temporary one)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="runs side by side, one process and one torch thread each (default: one per CPU)")
    args = parser.parse_args()
    margins = [float(m) for m in args.margins.split(",")]
    columns = [f"margin {m:g}: A / B" for m in margins] + [f"B gap, margin {m:g}" for m in margins[1:]]
    lines = ["| graph | model | seeds | " + " | ".join(columns) + " |", "|---|---|---|" + "---|" * len(columns)]
    graphs = [g for g in accuracy.SUITE if g.name in args.graphs.split(",")]
    with tempfile.TemporaryDirectory(prefix="retexo-margin-") as tmp:
        runs = measure(args.store or Path(tmp) / "store", graphs, args.datasets, args.models.split(","), margins,
                       args.seeds, args.jobs)
    for graph in graphs:
        for model in args.models.split(","):
            by_margin = {m: [runs[graph.name, model][m][s] for s in sorted(runs[graph.name, model][m])]
                         for m in margins}
            means = [f"{statistics.mean(a for a, _ in by_margin[m]):.3f} / "
                     f"{statistics.mean(b for _, b in by_margin[m]):.3f}" for m in margins]
            gaps = [gap([b for _, b in by_margin[m]], [b for _, b in by_margin[margins[0]]]) for m in margins[1:]]
            seeds = len(by_margin[margins[0]])
            lines.append(f"| {graph.name} | {model} | {seeds} | " + " | ".join(means + gaps) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
