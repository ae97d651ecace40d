"""The pipeline at growing sizes: ingest, partition, train (retexo GCN and SAGE, default rounds) and report a
synthetic graph of 100k, 300k and 1M nodes (average degree 20, the generator's defaults), METIS
into 8 parts, each stage run as the CLI command a user would type.

It prints per stage the seconds and the peak resident memory of the whole process tree (the
command and every worker it starts) and of its largest process; per layer the same (memory
sampled while the layer trained, dated by its manifest); the bytes on the wire by kind and the test
accuracy; and the fitted growth exponent of time and memory against the number of edges (the
slope of log(value) against log(edges), least squares). As references it trains ``standard`` on
the smallest graph (bytes and seconds per epoch) and ``centralized --layerwise`` (accuracy).

Next to every command's measured peak it prints the memory estimate that the command checked
before it started (``graphstore.limits``, computed from the same dataset, partition and options)
and their ratio. ``--out`` keeps the measurements as JSON; ``--tables FILE --store DIR`` prints the
tables again from them, with the estimates of the current code (the store must be the one measured).

    .venv/bin/python benchmarks/scale.py [--sizes 100000,300000,1000000] [--parts 8] [--store DIR] [--out FILE]
        [--device auto|cpu|cuda] [--skip-references]
    .venv/bin/python benchmarks/scale.py --tables FILE --store DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import Measured, run_measured  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from retexo_core.comm.log import KINDS as TRAFFIC_KINDS  # noqa: E402

RETEXO = [sys.executable, "-m", "cli"]
KINDS = tuple(k for k in TRAFFIC_KINDS if k not in ("halo_grads", "model_sync"))  # those of a layer-wise run


def retexo(store: Path, *args: str) -> Measured:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return run_measured([*RETEXO, *args, "--store", str(store)], REPO, env)


def newest_run(store: Path) -> Path:
    return max(store.glob("runs/run=*/manifest.json"), key=lambda p: p.stat().st_mtime).parent


def layer_phases(run: Path, measured: Measured, started_at: float, model: str) -> list[tuple[str, float, int, int]]:
    """(stage, seconds, peak tree, peak process) of each layer, and of what follows the last one
    (the run's finalisation), dated by the layer manifests' modification times."""
    ends = sorted((json.loads((d / "manifest.json").read_text())["layer"], (d / "manifest.json").stat().st_mtime - started_at)
                  for d in run.glob("layer=*"))
    phases, begin = [], 0.0
    for layer, end in ends:
        seconds = json.loads((run / f"layer={layer}" / "manifest.json").read_text())["seconds"]
        phases.append((f"{model} layer {layer}", seconds, *measured.peak_between(begin, end)))
        begin = end
    phases.append((f"{model} finalise run", measured.seconds - begin, *measured.peak_between(begin, measured.seconds)))
    return phases


def measure_size(store: Path, nodes: int, parts: int, models: list[str], device: str = "auto") -> dict:
    import time

    name = f"sbm{nodes // 1000}k"
    rows, manifests = [], {}
    ingest = retexo(store, "ingest", "synthetic", "--name", name, "--nodes", str(nodes), "--avg-degree", "20")
    rows.append(("ingest", ingest.seconds, ingest.peak_tree_bytes, ingest.peak_process_bytes))
    partition = retexo(store, "partition", name, "--parts", str(parts))
    rows.append(("partition", partition.seconds, partition.peak_tree_bytes, partition.peak_process_bytes))
    for model in models:
        started_at = time.time()
        # without the last two layers together, which run layer L-1 at every halo row (configs/synthetic_1m.yaml)
        train = retexo(store, "train", name, "--parts", str(parts), "--model", model, "--device", device,
                       "--joint-rounds", "0")
        run = newest_run(store)
        rows.append((f"train {model} (command)", train.seconds, train.peak_tree_bytes, train.peak_process_bytes))
        rows += layer_phases(run, train, started_at, model)
        report = retexo(store, "report", run.name.removeprefix("run="))
        rows.append((f"{model} report", report.seconds, report.peak_tree_bytes, report.peak_process_bytes))
        manifests[model] = json.loads((run / "manifest.json").read_text())
        print(f"  {name} {model}: test accuracy {manifests[model]['test_acc']:.4f}", flush=True)
    edges = json.loads(next(store.glob(f"datasets/name={name}/fp=*/manifest.json")).read_text())["num_edges"]
    return {"name": name, "nodes": nodes, "edges": edges, "rows": rows, "manifests": manifests}


def estimates(store: Path, result: dict, parts: int, models: list[str], on_gpu: bool = False) -> dict[str, int]:
    """The memory estimate each command of ``result`` checks before it starts, in bytes."""
    from graphstore.ingest.synthetic import SyntheticOptions, memory_estimate
    from graphstore.layout import Store
    from graphstore.limits import partition_estimate
    from graphstore.lookup import find_dataset, find_partition
    from graphstore.partition.methods import PartitionOptions
    from retexo_core.config import TrainConfig
    from runner.lifecycle import training_memory
    from runner.request import RunRequest, prepare_run

    st = Store.open(store)
    ref = find_dataset(st, result["name"])
    partition = find_partition(st, ref, PartitionOptions(parts=parts))
    found = {"ingest": memory_estimate(SyntheticOptions(name=result["name"], nodes=result["nodes"], avg_degree=20)),
             "partition": partition_estimate(ref.num_nodes, ref.num_edges, parts)}
    for model in models:
        plan = prepare_run(RunRequest.over(st, ref, partition, TrainConfig(model=model, joint_rounds=0)),
                           partitions="stored")
        found[f"train {model} (command)"] = training_memory(plan, plan.world, on_gpu)
    return {stage: estimate.bytes for stage, estimate in found.items()}


def reference(store: Path, name: str, parts: int, *args: str) -> dict:
    measured = retexo(store, "train", name, "--parts", str(parts), *args)
    manifest = json.loads((newest_run(store) / "manifest.json").read_text())
    return {"seconds": measured.seconds, "manifest": manifest}


def exponent(edges: list[int], values: list[float]) -> float:
    """Slope of log(value) against log(edges)."""
    if len(edges) < 2 or min(values) <= 0:
        return float("nan")
    return float(np.polyfit(np.log(edges), np.log(values), 1)[0])


def gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,300000,1000000")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--store", type=Path, default=None)
    parser.add_argument("--models", default="gcn,sage", help="retexo models trained at every size")
    parser.add_argument("--reference-epochs", type=int, default=20, help="epochs of the standard reference")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the trainings run")
    parser.add_argument("--skip-references", action="store_true", help="no standard / layer-wise reference runs")
    parser.add_argument("--out", type=Path, help="also write the measurements as JSON here")
    parser.add_argument("--tables", type=Path, help="only print the tables of an earlier --out file (with --store)")
    args = parser.parse_args()
    if args.tables:
        if args.store is None:
            parser.error("--tables needs the --store that was measured")
        measured = json.loads(args.tables.read_text())
        print_tables(measured, args.store)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    models = args.models.split(",")
    with tempfile.TemporaryDirectory(prefix="retexo-scale-") as tmp:
        store = args.store or Path(tmp) / "store"
        results = [measure_size(store, n, args.parts, models, args.device) for n in sizes]
        small = results[0]["name"]
        standard = layerwise = None
        if not args.skip_references:
            device = ("--device", args.device)
            standard = reference(store, small, args.parts, "--strategy", "standard", "--epochs",
                                 str(args.reference_epochs), *device)
            layerwise = reference(store, small, args.parts, "--strategy", "centralized", "--layerwise", *device)
        from runner.gpus import training_gpus

        measured = {"parts": args.parts, "models": models, "results": results, "standard": standard,
                    "layerwise": layerwise, "on_gpu": bool(training_gpus(args.device))}
        if args.out:
            args.out.write_text(json.dumps(measured, indent=1))
        print_tables(measured, store)


def print_tables(measured: dict, store: Path) -> None:
    results, models, parts = measured["results"], measured["models"], measured["parts"]
    standard, layerwise, small = measured["standard"], measured["layerwise"], measured["results"][0]["name"]
    print("\n| graph | edges | stage | estimate checked before the command (GB) | peak RSS, process tree (GB) | "
          "estimate / measured |")
    print("|---|---|---|---|---|---|")
    for r in results:
        estimated = estimates(store, r, parts, models, measured.get("on_gpu", False))
        for stage, _, tree, _ in r["rows"]:
            if stage in estimated:
                print(f"| {r['name']} | {r['edges']:,} | {stage} | {gb(estimated[stage])} | {gb(tree)} | "
                      f"{estimated[stage] / tree:.2f} |")

    print("\n| graph | edges | stage | seconds | peak RSS, process tree (GB) | peak RSS, largest process (GB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for stage, seconds, tree, largest in r["rows"]:
            print(f"| {r['name']} | {r['edges']:,} | {stage} | {seconds:.1f} | {gb(tree)} | {gb(largest)} |")

    print("\n| graph | model | test acc | total MB | " + " | ".join(f"{k} MB" for k in KINDS) + " | train s per round |")
    print("|---|---|---|---|" + "---|" * len(KINDS) + "---|")
    for r, model in ((r, model) for r in results for model in models):
        m = r["manifests"][model]
        rounds = sum(m["config"]["rounds"]) if isinstance(m["config"]["rounds"], list) else m["config"]["rounds"] * m["config"]["layers"]
        print(f"| {r['name']} | {model} | {m['test_acc']:.4f} | {m['total_bytes'] / 1e6:,.1f} | "
              + " | ".join(f"{m['bytes_by_kind'].get(k, 0) / 1e6:,.1f}" for k in KINDS)
              + f" | {m['wall_s'] / rounds:.3f} |")
    if standard is None or layerwise is None:
        print("\n(no reference runs: --skip-references)")
    else:
        print_references(small, standard, layerwise)
    print_growth(results, models)


def print_references(small: str, standard: dict, layerwise: dict) -> None:
    s = standard["manifest"]
    print(f"\nreference on {small}: standard, {s['config']['epochs']} epochs: {s['wall_s'] / s['config']['epochs']:.3f} s per "
          f"epoch inside the workers, {s['total_bytes'] / 1e6:,.1f} MB in total "
          f"({s['total_bytes'] / s['config']['epochs'] / 1e6:,.1f} MB per epoch), test acc {s['test_acc']:.4f}")
    print(f"reference on {small}: centralized layer-wise test acc {layerwise['manifest']['test_acc']:.4f}")


def print_growth(results: list[dict], models: list[str]) -> None:
    edges = [r["edges"] for r in results]
    print("\ngrowth exponents against edges (1.0 = linear):")
    for stage in ("ingest", "partition", *(f"train {model} (command)" for model in models)):
        seconds = [next(row[1] for row in r["rows"] if row[0] == stage) for r in results]
        memory = [next(row[2] for row in r["rows"] if row[0] == stage) for r in results]
        print(f"  {stage}: time {exponent(edges, seconds):.2f}, memory {exponent(edges, memory):.2f}")
    pipeline = ("ingest", "partition", f"train {models[0]} (command)")
    total = [sum(row[1] for row in r["rows"] if row[0] in pipeline) for r in results]
    peak = [max(row[2] for row in r["rows"] if row[0] in pipeline or row[0].startswith(f"{models[0]} ")) for r in results]
    print(f"  ingest + partition + train {models[0]}: time {exponent(edges, total):.2f}, peak memory {exponent(edges, peak):.2f}")
    print(f"wall time of ingest + partition + train {models[0]}: "
          + ", ".join(f"{r['name']} {math.fsum(row[1] for row in r['rows'] if row[0] in pipeline):.0f} s"
                      for r in results))


if __name__ == "__main__":
    main()
