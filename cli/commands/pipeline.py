"""``retexo run``: the whole pipeline as a Prefect flow in this process, then the stages' status,
the promotion gate's decision and the run next to its baselines."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from cli.commands.train import check_local_workers, stop_on_sigterm
from cli.console import out, print_table, training_bars
from cli.shared_options import StoreOption, open_store
from graphstore.units import human_bytes

if TYPE_CHECKING:
    from graphstore.manifests import RunManifest


def show_comparison(runs: list[RunManifest]) -> None:
    """One row per run: the first is the pipeline's run, the others its baselines."""
    first = runs[0]
    title = f"run {first.fp}: {first.label} {first.model} on {first.dataset_name} ({first.parts} parts, {first.method})"
    if len(runs) > 1:
        title += " vs " + ", ".join(r.label for r in runs[1:])
    title += f"; comm. simulated at {first.network['bandwidth_mbps']:g} Mbit/s"
    metric = "ROC-AUC" if first.score_name("test") == "roc_auc" else "acc"
    print_table(title, ["strategy", "run", f"test {metric}", f"val {metric}", "bytes", "sim. comm s", "training s"],
                [[r.label, r.fp[:8], f"{r.score('test'):.4f}", f"{r.score('val'):.4f}", human_bytes(r.total_bytes),
                  f"{r.sim_comm_s:.1f}", f"{r.wall_s:.1f}"] for r in runs])


def run_cmd(
    config: Annotated[Path, typer.Argument(help="YAML preset (see configs/): dataset, partition, train, network.")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a key, e.g. --set train.rounds=50 (repeatable).")] = None,
    store: StoreOption = None,
) -> None:
    """Run the whole pipeline as a Prefect flow: ingest -> partition -> train -> evaluate -> report
    (-> promotion gate, with promotion.pipeline set). Stages whose output is already in the store
    are reported as cached. Exit code 1 when the gate refuses the new run."""
    from flows.params import load_params
    from graphstore.manifests import RunManifest, read_manifest

    from cli.prefect_runtime import prepare_environment, run_flow_here

    stop_on_sigterm()  # outside the flow; while it runs, Prefect's own handler (see stop_on_sigterm)
    params = load_params(config, set_)
    check_local_workers(params.partition.parts, params.train.strategy)  # type: ignore[union-attr]
    if store is not None:
        params = params.model_copy(update={"store": str(store)})
    prepare_environment()
    from flows.pipeline import pipeline_flow  # Prefect is imported only when a flow runs
    from tasks.train import show_training_with

    show_training_with(training_bars)

    state = run_flow_here(pipeline_flow, params)
    result = state.result(raise_on_failure=False)
    if not isinstance(result, dict):  # a failure before the run finished: its exception
        raise result
    print_table("stages", ["stage", "status"], list(result["stages"].items()))
    if "promotion" in result:
        decision = result["promotion"]
        out.print(f"promotion gate of {decision['pipeline']}: {decision['decision']} ({decision['reason']})")
    st = open_store(params.store)
    runs = [read_manifest(st.run_dir(fp), RunManifest) for fp in [result["run"], *result["compared"]]]
    out.print(f"report: {result['report']}", soft_wrap=True)
    show_comparison(runs)
    out.print(f"plot:   {result['plot']}", soft_wrap=True)
    if state.is_failed():
        raise typer.Exit(1)
