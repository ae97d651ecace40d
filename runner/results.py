"""``RunFolder``: the result writer the lifecycle hands to the workers (``retexo_core.results``).

Every stage (layer) of a launch is written into a temporary sibling of its final folder: each
rank writes and fsyncs ``part=<rank>/{embeddings,comm}.parquet`` (and, in the last layer,
``predictions.parquet``); rank 0 then writes
``model.pt``, ``metrics.parquet`` and ``evaluation.parquet`` and commits the folder with its
manifest (rename), which records the sha256 of every file (``graphstore.atomic.commit_directory``):
each rank hashes the files it wrote (``graphstore.integrity.record_digests``), so rank 0 never
reads another rank's part; rank 0 hashes its own files.
The launcher on node 0 holds the layer folders' writer locks meanwhile.

What a rank reads of earlier layers (its own part's embeddings, a warm start's ``model.pt``) is
hashed against the checksums of the layer manifest listing it first: a file changed after it was
written is a ``StoreError`` naming it.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.atomic import commit_directory, fsync_file, fsync_tree
from graphstore.integrity import record_digests, verify_files
from graphstore.layout import Store
from graphstore.manifests import LayerManifest, read_manifest
from graphstore.parquet_io import COMPRESSION, read_table
from graphstore.runs import LINK_SCORES, PREDICTIONS, RECOMMENDATIONS, read_embeddings, write_embeddings
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.launcher_watch import ensure_launcher_alive

if TYPE_CHECKING:
    import torch

    from retexo_core.comm.communicator import Communicator

    from retexo_core.results import LayerSummary


TRAFFIC = "traffic.json"  # a site run's last layer, at the coordinator: every site's bytes
PROGRESS_EVERY_S = 0.25  # seconds between two progress files of one rank
_last_progress: dict[tuple[str, int], float] = {}  # (run, rank) -> when its progress was last written
_unwritten: dict[tuple[str, int], dict[str, Any]] = {}  # (run, rank) -> its newest progress not written yet
_best_val: dict[tuple[str, int, int], tuple[int, float | None]] = {}  # (run, layer, rank) -> (done, best val acc)


@dataclass(frozen=True)
class RoundProgress:
    """Where a launch is: ``done`` of ``total`` rounds (epochs) of ``layer`` (0: an end-to-end model)
    as rank 0 last reported, its last global val accuracy and the best so far (the accuracy of the
    parameters the layer keeps: ``retexo_core.strategies.common.BestState`` keeps the first best),
    and the bytes every rank has sent so far."""

    layer: int
    done: int
    total: int
    val_acc: float | None
    bytes_sent: int
    best_val_acc: float | None = None
    depth: int | None = None  # a depth choice: the layers of the run it belongs to (``runner.lifecycle``)


def progress_path(store_root: str, run_fp: str, layer: int, part: int) -> Path:
    """``runs/run=<fp>/logs/progress/layer=<layer>/rank-<part>.json``: the last progress a rank
    reported for ``layer`` (0: an end-to-end model)."""
    return Store(Path(store_root)).run_dir(run_fp) / "logs" / "progress" / f"layer={layer}" / f"rank-{part}.json"


def read_progress(store_root: str, run_fp: str, layer: int, world: int) -> RoundProgress | None:
    """The progress of ``layer`` from the ranks' files (None before rank 0 wrote one)."""
    reports = {}
    for part in range(world):
        try:
            reports[part] = json.loads(progress_path(store_root, run_fp, layer, part).read_text())
        except (OSError, ValueError):
            continue
    if 0 not in reports:
        return None
    first = reports[0]
    return RoundProgress(first["layer"], first["done"], first["total"], first["val_acc"],
                         sum(int(r["bytes_sent"]) for r in reports.values()), first.get("best_val_acc"))


def clear_progress(store_root: str, run_fp: str) -> None:
    """Remove the progress files of an earlier launch of the run."""
    folder = progress_path(store_root, run_fp, 0, 0).parent.parent
    for path in folder.glob("layer=*/*.json") if folder.is_dir() else ():
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class StageSpec:
    """A layer folder one launch produces: its fingerprint, final path and temporary path."""

    layer: int
    fp: str
    target: str
    temp: str


@dataclass(frozen=True)
class RunFolder:
    """Writes a launch's layers into ``runs/run=<run_fp>/`` (picklable: paths and options only)."""

    store_root: str
    run_fp: str
    config: TrainConfig
    world: int
    stages: tuple[StageSpec, ...]
    site_network: NetworkModel | None = None  # set for a site's run: every site commits its own layers

    @property
    def every_rank_commits(self) -> bool:
        return self.site_network is not None

    def stage(self, layer: int) -> StageSpec:
        return next(s for s in self.stages if s.layer == layer)

    def previous_outputs(self, layer: int, part: int, node_id: np.ndarray) -> dict[str, np.ndarray]:
        """View -> (n, d) rows of layer ``layer`` for this rank's ``node_id`` (n,), read from the
        layer's ``part=<part>/embeddings.parquet`` after hashing it against the layer manifest."""
        store = Store(Path(self.store_root))
        path = store.embeddings_path(self.run_fp, layer, part)
        verify_files(store.layer_dir(self.run_fp, layer), [f"part={part}/embeddings.parquet"], LayerManifest)
        stored_ids, views = read_embeddings(path)
        if not np.array_equal(stored_ids, node_id):
            raise RuntimeError(f"rank {part}: embeddings at {path} do not match the partition's nodes")
        return views

    def write_part(self, layer: int, part: int, node_id: np.ndarray, outputs: dict[str, np.ndarray],
                   comm: pa.Table) -> None:
        self._write_progress(part)  # the last rounds, if they came sooner than PROGRESS_EVERY_S (early stop)
        folder = Path(self.stage(layer).temp) / f"part={part}"
        write_embeddings(folder / "embeddings.parquet", node_id, outputs["full"],
                         {v: rows for v, rows in outputs.items() if v != "full"})
        pq.write_table(comm, folder / "comm.parquet", compression=COMPRESSION)
        fsync_tree(folder)
        record_digests(folder.parent, [f"part={part}/embeddings.parquet", f"part={part}/comm.parquet"], f"rank-{part}")

    def _stored_model(self, run_fp: str, layer: int) -> dict[str, torch.Tensor]:
        """``model.pt`` of run ``run_fp``'s layer ``layer``, hashed against its layer manifest first."""
        import torch

        folder = Store(Path(self.store_root)).layer_dir(run_fp, layer)
        verify_files(folder, ["model.pt"], LayerManifest)
        return torch.load(folder / "model.pt", weights_only=True)

    def stored_state(self, layer: int) -> dict[str, torch.Tensor]:
        return self._stored_model(self.run_fp, layer)

    def stored_head(self, layer: int) -> dict[str, torch.Tensor]:
        state = self.stored_state(layer)
        return {"weight": state["head.weight"], "bias": state["head.bias"]}

    def stored_recipe(self, layer: int) -> dict[str, Any]:
        folder = Store(Path(self.store_root)).layer_dir(self.run_fp, layer)
        return read_manifest(folder, LayerManifest).recipe

    def initial_state(self, layer: int) -> dict[str, torch.Tensor] | None:
        """The warm-start run's layer; for layer L-1, its block as the last two layers trained on it
        where the warm-start run kept that pair (the last layer's ``joint_hidden.*``)."""
        from retexo_core.strategies.joint import HIDDEN_PREFIX

        warm = self.config.warm_start
        if warm is None:
            return None
        state = self._stored_model(warm, layer)
        if layer == self.config.layers - 1:
            last = self._stored_model(warm, self.config.layers)
            state.update({"block." + k.removeprefix(HIDDEN_PREFIX): v for k, v in last.items()
                          if k.startswith(HIDDEN_PREFIX)})
        return state

    def progress(self, layer: int, part: int, done: int, total: int, val_acc: float | None, bytes_sent: int) -> None:
        """``ResultSink.progress``: this rank's position and its best val accuracy so far, in
        ``progress_path`` (replaced atomically, at most every ``PROGRESS_EVERY_S``, at the last
        round, and when the rank writes its part: ``write_part``), for the launcher's display."""
        now = time.monotonic()
        key, best_key = (self.run_fp, part), (self.run_fp, layer, part)
        before_done, best = _best_val.get(best_key, (0, None))
        if done <= before_done:  # the layer starts again (a new attempt of the launch)
            best = None
        if val_acc is not None and not math.isnan(val_acc) and (best is None or val_acc > best):
            best = val_acc
        _best_val[best_key] = (done, best)
        _unwritten[key] = {"layer": layer, "done": done, "total": total, "val_acc": val_acc, "best_val_acc": best,
                           "bytes_sent": bytes_sent}
        if done == total or now - _last_progress.get(key, -PROGRESS_EVERY_S) >= PROGRESS_EVERY_S:
            _last_progress[key] = now
            self._write_progress(part)

    def _write_progress(self, part: int) -> None:
        """Write this rank's newest unwritten progress, if any."""
        report = _unwritten.pop((self.run_fp, part), None)
        if report is None:
            return
        path = progress_path(self.store_root, self.run_fp, report["layer"], part)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".tmp-{path.name}")
        temp.write_text(json.dumps(report))
        os.replace(temp, path)

    def write_predictions(self, part: int, node_id: np.ndarray, predicted: np.ndarray, score: np.ndarray,
                          split: np.ndarray) -> None:
        self._write_last_layer(part, PREDICTIONS, pa.table({
            "node_id": pa.array(node_id, pa.int64()), "predicted": pa.array(predicted, pa.int64()),
            "score": pa.array(score, pa.float32()), "split": pa.array(split, pa.string())}), "predictions")

    def write_link_scores(self, part: int, src: np.ndarray, dst: np.ndarray, score: np.ndarray, label: np.ndarray,
                          split: np.ndarray) -> None:
        self._write_last_layer(part, LINK_SCORES, pa.table({
            "src": pa.array(src, pa.int64()), "dst": pa.array(dst, pa.int64()), "score": pa.array(score, pa.float32()),
            "label": pa.array(label, pa.int8()), "split": pa.array(split, pa.string())}), "link-scores")

    def write_recommendations(self, part: int, rows: dict[str, np.ndarray]) -> None:
        self._write_last_layer(part, RECOMMENDATIONS, pa.table({
            "node_id": pa.array(rows["node_id"], pa.int64()), "candidate": pa.array(rows["candidate"], pa.int64()),
            "score": pa.array(rows["score"], pa.float32()), "rank": pa.array(rows["rank"], pa.int32())}),
            "recommendations")

    def _write_last_layer(self, part: int, name: str, table: pa.Table, what: str) -> None:
        """``table`` as ``part=<part>/<name>`` of the last layer's temporary folder, fsynced, with
        its digest recorded for the layer's manifest."""
        path = Path(self.stage(self.config.layers).temp) / f"part={part}" / name
        pq.write_table(table, path, compression=COMPRESSION)
        fsync_file(path)
        record_digests(path.parent.parent, [f"part={part}/{name}"], f"rank-{part}-{what}")

    def gather_traffic(self, comm: Communicator) -> None:
        """``ResultSink.gather_traffic``: in a site's run, every site tells the coordinator its
        bytes (``retexo_core.sites.gather_traffic``: this launch's log and its own rows of the
        layers committed before it); the coordinator writes them to ``traffic.json`` of the last
        layer. Nothing happens in other runs."""
        if self.site_network is None:
            return
        from retexo_core.sites import gather_traffic

        store, first = Store(Path(self.store_root)), min(s.layer for s in self.stages)
        earlier = [read_table(store.layer_dir(self.run_fp, l) / f"part={comm.rank}" / "comm.parquet")
                   for l in range(1, first)]
        summary = gather_traffic(comm, pa.concat_tables([*earlier, comm.log.to_table()]), self.site_network)
        if summary is not None:
            path = Path(self.stage(self.config.layers).temp) / TRAFFIC
            path.write_text(json.dumps(summary, sort_keys=True))
            fsync_file(path)

    def commit_layer(self, summary: LayerSummary, state: dict[str, torch.Tensor] | None, history: pa.Table | None,
                     evaluation: list[dict[str, Any]] | None) -> None:
        import torch

        stage = self.stage(summary.layer)
        temp = Path(stage.temp)
        written = [temp / "model.pt"] if state is not None else []
        if state is not None:
            torch.save(state, written[0])
        if history is not None:
            written.append(temp / "metrics.parquet")
            pq.write_table(history, written[-1], compression=COMPRESSION)
        if evaluation is not None:
            written.append(temp / "evaluation.parquet")
            pq.write_table(pa.Table.from_pylist(evaluation), written[-1], compression=COMPRESSION)
        for path in written:
            fsync_file(path)
        cfg = self.config
        ensure_launcher_alive()  # no commit once the lock-holding launcher is gone
        commit_directory(temp, Path(stage.target), LayerManifest(
            fp=stage.fp, run=self.run_fp, layer=summary.layer, parts=self.world, strategy=cfg.strategy,
            model=cfg.model, last=summary.layer == cfg.layers,
            options=cfg.layer_payload(summary.layer) if cfg.is_layerwise else cfg.run_payload(),
            best_round=summary.best_round, best_val=summary.best_val, rounds=summary.rounds,
            seconds=round(summary.seconds, 3), dropped_parts=summary.dropped_parts, recipe=summary.recipe,
            platform=summary.platform,
        ), contents_synced=True)
