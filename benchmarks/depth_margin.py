"""The depth choice's margin, judged on validation nodes that no choice saw.

The depth choice (``runner/depth.py``) keeps the deeper model on any higher validation score. A
margin would keep it only where it classifies more validation nodes right than the shallower model
by more than ``m`` standard errors of that paired difference (gained - lost > m * sqrt(gained +
lost), the recipe search's ``--recipe-margin`` rule). As for that margin, the choice cannot be
judged on the validation split it was made on, nor on test. So every run is trained under
``search_margin.py``'s nested validation: the recipe search, early stopping and the depth choice
see half A of the validation split, and half B stands in for the test split (no test label is
read). Both depths' runs are in the store with their predictions, so one training gives every
margin's choice: each is computed from the same two runs' half-A predictions and scored on half B.

For each graph, model and variant (default ``centralized`` and ``centralized --layerwise``), the
suite's seeds (``benchmarks/accuracy.py``; ``--seeds`` for fewer), 4 random parts (seed 0), ranks as
threads; with ``--holdout``, the graphs' stratified 60/20/20 split of ``holdout_split.py`` (the
protocol of the graphs we are checked on) and training seeds 0..N-1 on it. It prints each
margin's half-A and half-B means, how often the deeper model is kept, and the paired gap of half B
against margin 0 ± its standard error over the seeds. Accuracy graphs only: a ROC-AUC (two-class)
graph has no node-by-node count.

With ``--validation half-a`` the runs validate on half A and test on the graph's test split (half B
unlabelled), with ``whole`` on the graph's own split: column B is then the test split, and
``--against`` of the two measures what halving the validation costs each variant on test.

    .venv/bin/python benchmarks/depth_margin.py [--graphs cora,citeseer] [--models gcn,sage,gat]
        [--variants centralized,"centralized --layerwise"] [--margins 0,0.5,1] [--seeds N] [--holdout]
        [--jobs N] [--store DIR] [--out FILE] [--validation halves|half-a|whole]
    .venv/bin/python benchmarks/depth_margin.py --tables FILE... [--margins 0,0.5,1]   # runs of --out
    .venv/bin/python benchmarks/depth_margin.py --tables FILE... --against FILE... [--margins 0]  # two arms, paired
        [--against-variant centralized]  # each run against that variant's run of the same seed
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy  # noqa: E402
import holdout_split  # noqa: E402
import search_margin  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.lookup import DatasetRef  # noqa: E402
from graphstore.manifests import RunManifest  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.parquet_io import read_table  # noqa: E402
from graphstore.runs import PREDICTIONS  # noqa: E402
from runner.depth import depth_choice  # noqa: E402


def correct_by_split(store: Store, run: RunManifest) -> dict[str, str]:
    """Split ("val": half A, "test": half B) -> whether the run's last layer classifies each of its
    nodes right, in node-id order: "1" right, "0" wrong."""
    last = store.layer_dir(run.fp, len(run.layers))
    predictions = pa.concat_tables([read_table(p) for p in sorted(last.glob(f"part=*/{PREDICTIONS}"))])
    nodes = read_table(store.dataset_dir(run.dataset_name, run.dataset) / "nodes.parquet",
                       columns=["node_id", "label"])
    label = dict(zip(nodes["node_id"].to_pylist(), nodes["label"].to_pylist()))
    out: dict[str, str] = {}
    for split in ("val", "test"):
        rows = predictions.filter(pc.equal(predictions["split"], split))
        order = np.argsort(rows["node_id"].to_numpy())
        ids, predicted = rows["node_id"].to_numpy()[order], rows["predicted"].to_numpy()[order]
        out[split] = "".join("1" if p == label[int(i)] else "0" for i, p in zip(ids, predicted))
    return out


def one_run(store_path: Path, graph: str, dataset: DatasetRef, partition: object, model: str, variant: str,
            seed: int) -> dict[str, Any]:
    """One run, its validation split as the job's ``--validation`` sets it: both depths' per-node
    results (a run of one depth, such as ``--recipe default``'s, as both: every margin keeps it)."""
    store = Store.open(store_path)
    plan, kept = accuracy.train_plan(store, dataset, partition, accuracy.ALL_VARIANTS[variant], model, seed)
    if plan.deeper is None:
        shallower = deeper = kept
    else:
        choice = depth_choice(plan)
        shallower, deeper = choice.shallower, choice.deeper
    return {"graph": graph, "model": model, "variant": variant, "seed": seed, "layers": len(shallower.layers),
            "shallower": correct_by_split(store, shallower), "deeper": correct_by_split(store, deeper)}


def share_right(correct: str) -> float:
    """The accuracy of a string of ``correct_by_split``."""
    return correct.count("1") / len(correct)


def keeps_deeper(run: dict[str, Any], margin: float) -> bool:
    """Whether the depth choice with ``margin`` keeps the deeper model: it classifies more half-A
    nodes right than the shallower one by more than ``margin`` standard errors (McNemar)."""
    pairs = list(zip(run["shallower"]["val"], run["deeper"]["val"]))
    gained, lost = pairs.count(("0", "1")), pairs.count(("1", "0"))
    return gained - lost > margin * math.sqrt(gained + lost)


def scores(run: dict[str, Any], margin: float) -> tuple[float, float, bool]:
    """The kept depth's half-A and half-B accuracy under ``margin``, and whether it is the deeper."""
    deeper = keeps_deeper(run, margin)
    kept = run["deeper" if deeper else "shallower"]
    return share_right(kept["val"]), share_right(kept["test"]), deeper


def inputs(store: Store, graphs: list[accuracy.SuiteGraph], datasets: Path, seeds: int | None, holdout: bool,
           folder: Path) -> dict[tuple[str, int], tuple[DatasetRef, object]]:
    """(graph, seed) -> its dataset and 4 random parts (seed 0): the suite's split of the seed, or with
    ``holdout`` the one stratified 60/20/20 split of ``holdout_split.py`` for every seed."""
    out: dict[tuple[str, int], tuple[DatasetRef, object]] = {}
    if not holdout:
        accuracy.prepare_suite(store, graphs, datasets, seeds, 0)
    for graph in graphs:
        if holdout:
            drawn = holdout_split.resplit(store, datasets, graph.name, folder)
            parts = build_partition(store, drawn, accuracy.SUITE_PARTS)
            out.update({(graph.name, seed): (drawn, parts) for seed in range(seeds or 3)})
        else:
            out.update({(graph.name, seed): accuracy.suite_partition(store, graph, datasets, seed)
                        for seed in range(graph.seeds(seeds))})
    return out


def measure(store_path: Path, jobs_inputs: dict[tuple[str, int], tuple[DatasetRef, object]], models: list[str],
            variants: list[str], jobs: int, out: Path | None, validation: str = "halves") -> list[dict[str, Any]]:
    """Every (graph, seed) of ``jobs_inputs`` with every model and variant, as a job of ``jobs``
    processes side by side, each seeing the validation split as ``search_margin.VALIDATION[validation]``
    sets it; each run is appended to ``out`` (one JSON line) as it ends, so that a stopped
    measurement keeps its runs."""
    tasks = [(g, s, m, v) for (g, s) in jobs_inputs for m in models for v in variants]
    runs = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=search_margin.start_worker,
                             initargs=(validation,)) as pool:
        futures = [pool.submit(one_run, store_path, g, *jobs_inputs[g, s], m, v, s) for g, s, m, v in tasks]
        for future in as_completed(futures):
            run = future.result()
            runs.append(run)
            if out is not None:
                with out.open("a") as sink:
                    sink.write(json.dumps(run) + "\n")
            a, b, deeper = scores(run, 0.0)
            print(f"{run['graph']} {run['model']} {run['variant']} seed {run['seed']}: margin 0 keeps "
                  f"{run['layers'] + deeper} layers, half A {a:.4f}, half B {b:.4f}", flush=True)
    return runs


def run_key(run: dict[str, Any]) -> tuple[str, str, str, int]:
    """What names a run: (graph, model, variant, seed)."""
    return run["graph"], run["model"], run["variant"], run["seed"]


def read_runs(*paths: Path) -> list[dict[str, Any]]:
    """The runs of ``--out`` files; a run trained again (a stopped measurement started again finds
    it in its store and appends it once more) counts once."""
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    return list({run_key(r): r for r in lines}.values())


Group = tuple[tuple[str, str, str], list[dict[str, Any]]]  # (graph, model, variant), its runs by seed


def grouped(runs: list[dict[str, Any]]) -> list[Group]:
    """The runs by (graph, model, variant), in suite order (model, then graph)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        groups.setdefault((run["graph"], run["model"], run["variant"]), []).append(run)
    names = [g.name for g in accuracy.SUITE]
    return sorted(groups.items(), key=lambda item: (accuracy.MODELS.index(item[0][1]), names.index(item[0][0]), item[0][2]))


def table(runs: list[dict[str, Any]], margins: list[float]) -> list[str]:
    """One row per (graph, model, variant): each margin's half-A / half-B means and deeper kept
    (of the seeds), and half B's paired gap to the first margin, in points."""
    columns = ([f"margin {m:g}: A / B (deeper kept)" for m in margins]
               + [f"half B, {m:g} against {margins[0]:g}" for m in margins[1:]])
    lines = ["| graph | model | variant | seeds | " + " | ".join(columns) + " |", "|---|---|---|---|" + "---|" * len(columns)]
    for (graph, model, variant), group in grouped(runs):
        by_margin = {m: [scores(r, m) for r in group] for m in margins}
        cells = [f"{statistics.mean(a for a, _, _ in by_margin[m]):.3f} / {statistics.mean(b for _, b, _ in by_margin[m]):.3f}"
                 f" ({sum(d for _, _, d in by_margin[m])})" for m in margins]
        base = [b for _, b, _ in by_margin[margins[0]]]
        cells += [search_margin.gap([b for _, b, _ in by_margin[m]], base) for m in margins[1:]]
        lines.append(f"| {graph} | {model} | {variant} | {len(group)} | " + " | ".join(cells) + " |")
    return lines


def summary(runs: list[dict[str, Any]], margins: list[float]) -> list[str]:
    """Per margin after the first: half B's gap to the first margin, in points, averaged over the
    table's rows, and the row that loses most."""
    lines = []
    for margin in margins[1:]:
        gaps = {key: 100 * statistics.mean(scores(r, margin)[1] - scores(r, margins[0])[1] for r in group)
                for key, group in grouped(runs)}
        worst = min(gaps, key=gaps.__getitem__)
        lines.append(f"margin {margin:g} against {margins[0]:g}: half B {statistics.mean(gaps.values()):+.2f} points on "
                     f"average over {len(gaps)} rows; at worst {gaps[worst]:+.2f} ({worst[0]} {worst[1]})")
    return lines


def paired_table(runs: list[dict[str, Any]], against: list[dict[str, Any]], margin: float,
                 against_variant: str | None = None) -> list[str]:
    """One row per (graph, model, variant) of ``runs`` with the same seeds in ``against`` (another
    arm, e.g. a patched search), paired with the run of the same variant, or with ``against_variant``
    the run of that variant (e.g. layer-wise against end-to-end training on the same halves): both
    arms' half-A / half-B means at ``margin``, the paired gaps of ``runs`` against ``against`` in
    points ± their standard error, and the runs whose predictions differ; last, the gaps averaged
    over the rows."""
    other = {run_key(r): r for r in against}

    def partner(run: dict[str, Any]) -> tuple[str, str, str, int]:
        return run["graph"], run["model"], against_variant or run["variant"], run["seed"]
    lines = ["| graph | model | variant | seeds | against: A / B | runs: A / B | half A gap | half B gap | runs changed |",
             "|---|---|---|---|---|---|---|---|---|"]
    means: list[tuple[float, float]] = []
    for (graph, model, variant), group in grouped(runs):
        pairs = [(other[partner(r)], r) for r in group if partner(r) in other]
        if not pairs:
            continue
        base = [scores(b, margin) for b, _ in pairs]
        mine = [scores(r, margin) for _, r in pairs]
        changed = sum((b["shallower"], b["deeper"]) != (r["shallower"], r["deeper"]) for b, r in pairs)
        arms = [f"{statistics.mean(a for a, _, _ in arm):.3f} / {statistics.mean(b for _, b, _ in arm):.3f}"
                for arm in (base, mine)]
        gaps = [search_margin.gap([x[i] for x in mine], [x[i] for x in base]) for i in (0, 1)]
        means.append(tuple(100 * statistics.mean(x[i] - y[i] for x, y in zip(mine, base)) for i in (0, 1)))
        lines.append(f"| {graph} | {model} | {variant} | {len(pairs)} | " + " | ".join(arms + gaps)
                     + f" | {changed} of {len(pairs)} |")
    if not means:
        return lines + ["", "no run of these has a partner in the other arm"]
    return lines + ["", f"over {len(means)} rows: half A {statistics.mean(a for a, _ in means):+.2f} points, "
                        f"half B {statistics.mean(b for _, b in means):+.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", type=Path, default=accuracy.REPO.parent / "shared" / "datasets")
    parser.add_argument("--graphs", default="cora,citeseer,chameleon_filtered,wisconsin")
    parser.add_argument("--models", default="gcn,sage,gat")
    parser.add_argument("--variants", default="centralized,centralized --layerwise")
    parser.add_argument("--margins", default="0,0.5,1", help="comma list; the first is the baseline of the gaps")
    parser.add_argument("--seeds", type=int, help="seeds of every graph (default: the suite's own; 3 with --holdout)")
    parser.add_argument("--holdout", action="store_true",
                        help="the graphs with holdout_split.py's stratified 60/20/20 split, training seeds 0..N-1")
    parser.add_argument("--validation", choices=sorted(search_margin.VALIDATION), default="halves",
                        help="halves (default): half A validates, half B tests; half-a: half A validates, the "
                        "test split tests (what the choices lose with half the validation); whole: the graph's "
                        "own split. A store holds runs of one of them only (their fingerprints are alike)")
    parser.add_argument("--store", type=Path, help="a store for these runs only (default: a temporary one)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="runs side by side, one process and one torch thread each (default: one per CPU)")
    parser.add_argument("--out", type=Path, help="append every run's per-node results here (JSON lines)")
    parser.add_argument("--tables", type=Path, nargs="+", help="print the table of runs written by --out, train nothing")
    parser.add_argument("--against", type=Path, nargs="+",
                        help="with --tables: the paired gaps of those runs against these (another arm), at the first margin")
    parser.add_argument("--against-variant",
                        help="with --against: pair each run with the run of this variant (same graph, model and seed)")
    args = parser.parse_args()
    margins = [float(m) for m in args.margins.split(",")]
    if args.tables and args.against:
        print("\n".join(paired_table(read_runs(*args.tables), read_runs(*args.against), margins[0],
                                        args.against_variant)))
        return
    if args.tables:
        runs = read_runs(*args.tables)
    else:
        graphs = [g for g in accuracy.SUITE if g.name in args.graphs.split(",")]
        variants = args.variants.split(",")
        with tempfile.TemporaryDirectory(prefix="retexo-depth-margin-") as tmp:
            store_path = args.store or Path(tmp) / "store"
            jobs_inputs = inputs(Store.open(store_path), graphs, args.datasets, args.seeds, args.holdout, Path(tmp))
            runs = measure(store_path, jobs_inputs, args.models.split(","), variants, args.jobs, args.out,
                           args.validation)
    print("\n".join(table(runs, margins) + [""] + summary(runs, margins)))


if __name__ == "__main__":
    main()
