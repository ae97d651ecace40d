"""Finalising a run: collect its layers' byte logs, curves and evaluation into the run folder and
write the run manifest last.

A site's run holds this site's rows only. Its coordinator (site 0) also has the evaluation and
``traffic.json`` (every site's bytes, ``retexo_core.sites.gather_traffic``), so its manifest's
totals and simulated time are those of the whole run; another site's manifest counts what it sent,
and its run folder has no ``metrics.parquet`` or ``evaluation.parquet``."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.atomic import atomic_write_file, writer_lock
from graphstore.errors import StoreError
from graphstore.layout import MANIFEST, is_complete
from graphstore.manifests import LayerManifest, LayerRef, RunManifest, manifest_json, read_manifest
from graphstore.integrity import folder_digests
from graphstore.parquet_io import COMPRESSION, read_table
from retexo_core.comm.network import bytes_by_kind, simulated_seconds, total_bytes
from retexo_core.recipe import run_recipe
from runner.plan import RunPlan, code_version, run_label
from runner.results import TRAFFIC

RECIPE = "recipe.json"  # the knobs each layer trained with, in the format --recipe FILE reads


def read_concat(paths: list[Path]) -> pa.Table:
    tables = [read_table(p) for p in paths]
    return pa.concat_tables(tables) if tables else pa.table({})


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=COMPRESSION)
    return sink.getvalue().to_pybytes()


def finalize_run(plan: RunPlan) -> RunManifest:
    """Write ``comm``, ``metrics``, ``evaluation`` and ``recipe.json`` of the whole run, then its manifest."""
    store, run_dir, cfg = plan.store, plan.store.run_dir(plan.run_fp), plan.config
    layer_dirs = [plan.layer_dir(l) for l in plan.layers]
    missing = [d.name for d in layer_dirs if not is_complete(d)]
    if missing:
        raise StoreError(f"run {plan.run_fp} cannot be finalised: missing {', '.join(missing)}")
    comm = read_concat(sorted(p for d in layer_dirs for p in d.glob("part=*/comm.parquet")))
    metrics = read_concat([d / "metrics.parquet" for d in layer_dirs if (d / "metrics.parquet").is_file()])
    last = layer_dirs[-1]
    evaluation = read_table(last / "evaluation.parquet") if plan.site in (None, 0) else pa.table({})
    layers = [read_manifest(d, LayerManifest) for d in layer_dirs]
    rows = evaluation.to_pylist()
    accuracy = {r["split"]: r["accuracy"] for r in rows}
    by_kind, total, simulated, by_site = bytes_by_kind(comm), total_bytes(comm), simulated_seconds(comm, plan.network)[0], {}
    if plan.site == 0:
        traffic = json.loads((last / TRAFFIC).read_text())
        by_kind, simulated = traffic["bytes_by_kind"], traffic["sim_comm_s"]
        by_site = {str(k): v for k, v in traffic["bytes_by_site"].items()}
        total = sum(by_kind.values())
    manifest = RunManifest(
        fp=plan.run_fp, dataset=plan.dataset_fp, dataset_name=plan.dataset_name, partition=plan.partition_fp,
        method=plan.partition_method, parts=plan.world, strategy=cfg.strategy, model=cfg.model,
        setting=cfg.setting, label=run_label(cfg), config=cfg.run_payload(), network=plan.network.model_dump(),
        test_acc=accuracy.get("test"), val_acc=accuracy.get("val"), train_acc=accuracy.get("train"),
        evaluation=rows, total_bytes=total, bytes_by_kind=by_kind,
        sim_comm_s=round(simulated, 6), wall_s=round(sum(m.seconds for m in layers), 3),
        layers=[LayerRef(layer=m.layer, fp=m.fp, reused_from=m.reused_from) for m in layers],
        code_version=code_version(plan.config.strategy), site=plan.site, bytes_by_site=by_site,
        recipe=run_recipe({m.layer: m.recipe for m in layers}),
        platform="; ".join(dict.fromkeys(m.platform_label for m in layers if m.platform)),
    )
    with writer_lock(store, run_dir):
        for name, table in (("comm.parquet", comm), ("metrics.parquet", metrics), ("evaluation.parquet", evaluation)):
            if table.num_columns:  # a site other than the coordinator has no curves and no evaluation
                atomic_write_file(store, run_dir / name, parquet_bytes(table))
        if manifest.recipe["layers"]:  # the recipe each layer trained with: --recipe FILE reuses it
            atomic_write_file(store, run_dir / RECIPE, (json.dumps(manifest.recipe, indent=1) + "\n").encode())
        manifest = manifest.model_copy(update={"files": folder_digests(run_dir, "run")})  # sha256 of the files above
        atomic_write_file(store, run_dir / MANIFEST, manifest_json(manifest).encode())
    return manifest
