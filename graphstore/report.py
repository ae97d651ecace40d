"""Run reports: a markdown summary and the accuracy-vs-bytes plot of every run on the same dataset.

Written into the store next to the run (``runs/run=<fp>/report/{report.md, accuracy_vs_bytes.png}``)
and regenerated on demand (``retexo report RUN``), since the plot grows with every new run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graphstore.atomic import atomic_write_file
from graphstore.layout import MANIFEST, Store
from graphstore.lookup import completed_run, dataset_runs
from graphstore.manifests import PartitionManifest, RunManifest, read_manifest
from graphstore.units import human_bytes

PLOT_NAME = "accuracy_vs_bytes.png"
REPORT_NAME = "report.md"


@dataclass(frozen=True)
class Report:
    manifest: RunManifest
    markdown: str
    plot_path: Path
    report_path: Path


def test_score(run: RunManifest) -> float | None:
    """The run's test score (``RunManifest.score``: accuracy, or ROC-AUC for links and two classes);
    None for a site's run without the evaluation."""
    return run.score("test") if any(r["split"] == "test" for r in run.evaluation) else None


def plot_accuracy_vs_bytes(runs: list[RunManifest], highlight: str, title: str) -> bytes:
    """PNG bytes: test score (y: accuracy, or ROC-AUC for links and two classes) against total bytes
    on the wire (x, log scale), one point per run; runs without traffic (centralized) are drawn as
    dashed horizontal reference lines."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    scores = {r.fp: test_score(r) for r in runs}
    with_traffic = [r for r in runs if r.total_bytes > 0 and scores[r.fp] is not None]
    for r in runs:
        if r.total_bytes == 0 and scores[r.fp] is not None:
            ax.axhline(scores[r.fp], linestyle="--", linewidth=0.8, color="grey")
            ax.annotate(f"{r.label} {r.model} (no traffic)", (0.01, scores[r.fp]), xycoords=("axes fraction", "data"),
                        fontsize=7, color="grey", va="bottom")
    for r in with_traffic:
        is_this = r.fp == highlight
        ax.scatter(r.total_bytes, scores[r.fp], s=60 if is_this else 30,
                   edgecolors="black" if is_this else "none", zorder=3)
        ax.annotate(f"{r.label} {r.model} K={r.parts}", (r.total_bytes, scores[r.fp]),
                    textcoords="offset points", xytext=(5, 4), fontsize=7)
    if with_traffic:
        ax.set_xscale("log")
    ax.set_xlabel("bytes on the network (log scale)")
    named = [r for r in runs if r.fp == highlight and scores[r.fp] is not None]
    ax.set_ylabel("test ROC-AUC" if named and named[0].score_name("test") == "roc_auc" else "test accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def evaluation_table(manifest: RunManifest) -> list[str]:
    """The markdown rows of the run's evaluation: per pair split (link task) or per node split."""
    rows = manifest.evaluation
    if manifest.config.get("task") == "link":
        return [f"| split | ROC-AUC | MRR | Hits@{manifest.config['hits_k']} | pairs |", "|---|---|---|---|---|",
                *(f"| {r['split']} | {r['roc_auc']:.4f} | {r['mrr']:.4f} | {r['hits_at_k']:.4f} | {r['pairs']} |"
                  for r in rows)]
    lines = ["| split | accuracy | macro-F1 | ROC-AUC | nodes |", "|---|---|---|---|---|"]
    for r in rows:
        auc = "" if r["roc_auc"] is None or r["roc_auc"] != r["roc_auc"] else f"{r['roc_auc']:.4f}"
        lines.append(f"| {r['split']} | {r['accuracy']:.4f} | {r['macro_f1']:.4f} | {auc} | {r['nodes']} |")
    return lines


def markdown_report(manifest: RunManifest, partition: PartitionManifest | None, plot_file: str) -> str:
    net = manifest.network
    lines = [
        f"# Run `{manifest.fp}`: {manifest.label} {manifest.model} on {manifest.dataset_name}",
        "",
        f"- dataset: **{manifest.dataset_name}** (`{manifest.dataset}`), setting: {manifest.setting}",
    ]
    if partition:
        lines.append(f"- partitions: {partition.method}, K = {partition.parts}, edge cut {partition.edge_cut:,}, "
                     f"halo total {partition.halo_total:,} (`{partition.fp}`)")
    else:
        lines.append("- partitions: none (centralized, one process)")
    lines.append(f"- strategy: {manifest.label}, layers {manifest.config['layers']}, hidden {manifest.config['hidden']}")
    if manifest.platform:
        lines.append(f"- trained with {manifest.platform}")
    lines.append("")
    lines += evaluation_table(manifest)
    lines += ["", "| traffic kind | bytes |", "|---|---|"]
    for kind, nbytes in sorted(manifest.bytes_by_kind.items()):
        lines.append(f"| {kind} | {human_bytes(nbytes)} ({nbytes:,}) |")
    lines += [f"| **total** | **{human_bytes(manifest.total_bytes)}** ({manifest.total_bytes:,}) |", "",
              f"Simulated communication time at {net['bandwidth_mbps']:g} Mbit/s and {net['latency_ms']:g} ms latency: "
              f"**{manifest.sim_comm_s:.2f} s**; training time inside the workers: {manifest.wall_s:.1f} s.", "",
              f"![accuracy vs bytes]({plot_file})", ""]
    return "\n".join(lines)


def write_report(store: Store, run: str, only_if_stale: bool = False) -> Report:
    """(Re)generate the run's markdown report and plot inside the store. With ``only_if_stale`` an
    existing report is kept when no run on the same dataset finished after it was written."""
    manifest = completed_run(store, run)
    folder = store.run_dir(manifest.fp) / "report"
    report_path, plot_path = folder / REPORT_NAME, folder / PLOT_NAME
    if only_if_stale and report_path.is_file() and plot_path.is_file():
        written = report_path.stat().st_mtime_ns
        runs = [store.run_dir(r.fp) / MANIFEST for r in dataset_runs(store, manifest.dataset)]
        if all(path.stat().st_mtime_ns <= written for path in runs):
            return Report(manifest, report_path.read_text(), plot_path, report_path)
    partition = None
    if manifest.partition:
        partition = read_manifest(store.partition_dir(manifest.dataset, manifest.partition), PartitionManifest)
    plot = plot_accuracy_vs_bytes(dataset_runs(store, manifest.dataset), manifest.fp,
                                  f"{manifest.dataset_name}: test score vs bytes on the network (all runs)")
    atomic_write_file(store, folder / PLOT_NAME, plot)
    markdown = markdown_report(manifest, partition, PLOT_NAME)
    atomic_write_file(store, folder / REPORT_NAME, markdown.encode())
    return Report(manifest, markdown, folder / PLOT_NAME, folder / REPORT_NAME)
