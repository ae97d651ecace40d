"""``RunFolder``: the result writer the lifecycle hands to the workers (``retexo_core.results``).

Every stage (layer) of a launch is written into a temporary sibling of its final folder: each
rank writes and fsyncs ``part=<rank>/{embeddings,comm}.parquet`` (and, in the last layer,
``predictions.parquet``); rank 0 then writes
``model.pt``, ``metrics.parquet`` and ``evaluation.parquet`` and commits the folder with its
manifest (rename). The launcher on node 0 holds the layer folders' writer locks meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.atomic import commit_directory, fsync_file, fsync_tree
from graphstore.layout import Store
from graphstore.manifests import LayerManifest
from graphstore.parquet_io import COMPRESSION
from graphstore.runs import PREDICTIONS, read_embeddings, write_embeddings
from retexo_core.config import TrainConfig

if TYPE_CHECKING:
    import torch

    from retexo_core.results import LayerSummary


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

    def stage(self, layer: int) -> StageSpec:
        return next(s for s in self.stages if s.layer == layer)

    def previous_outputs(self, layer: int, part: int, node_id: np.ndarray) -> dict[str, np.ndarray]:
        path = Store(Path(self.store_root)).embeddings_path(self.run_fp, layer, part)
        stored_ids, views = read_embeddings(path)
        if not np.array_equal(stored_ids, node_id):
            raise RuntimeError(f"rank {part}: embeddings at {path} do not match the partition's nodes")
        return views

    def write_part(self, layer: int, part: int, node_id: np.ndarray, outputs: dict[str, np.ndarray],
                   comm: pa.Table) -> None:
        folder = Path(self.stage(layer).temp) / f"part={part}"
        write_embeddings(folder / "embeddings.parquet", node_id, outputs["full"],
                         {v: rows for v, rows in outputs.items() if v != "full"})
        pq.write_table(comm, folder / "comm.parquet", compression=COMPRESSION)
        fsync_tree(folder)

    def initial_state(self, layer: int) -> dict[str, torch.Tensor] | None:
        import torch

        warm = self.config.warm_start
        if warm is None:
            return None
        return torch.load(Store(Path(self.store_root)).layer_dir(warm, layer) / "model.pt", weights_only=True)

    def write_predictions(self, part: int, node_id: np.ndarray, predicted: np.ndarray, score: np.ndarray,
                          split: np.ndarray) -> None:
        path = Path(self.stage(self.config.layers).temp) / f"part={part}" / PREDICTIONS
        table = pa.table({"node_id": pa.array(node_id, pa.int64()), "predicted": pa.array(predicted, pa.int64()),
                          "score": pa.array(score, pa.float32()), "split": pa.array(split, pa.string())})
        pq.write_table(table, path, compression=COMPRESSION)
        fsync_file(path)

    def commit_layer(self, summary: LayerSummary, state: dict[str, torch.Tensor], history: pa.Table | None,
                     evaluation: list[dict[str, Any]] | None) -> None:
        import torch

        stage = self.stage(summary.layer)
        temp = Path(stage.temp)
        written = [temp / "model.pt"]
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
        commit_directory(temp, Path(stage.target), LayerManifest(
            fp=stage.fp, run=self.run_fp, layer=summary.layer, parts=self.world, strategy=cfg.strategy,
            model=cfg.model, last=summary.layer == cfg.layers,
            options=cfg.layer_payload(summary.layer) if cfg.is_layerwise else cfg.run_payload(),
            best_round=summary.best_round, best_val=summary.best_val, rounds=summary.rounds,
            seconds=round(summary.seconds, 3), dropped_parts=summary.dropped_parts,
        ), contents_synced=True)
