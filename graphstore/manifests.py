"""Typed manifests: the one reader and the one writer of every artefact's ``manifest.json``.

An artefact folder exists for readers only once its manifest is written (``graphstore.atomic``);
the manifest says what the folder holds. Each kind has a pydantic model here; unknown keys of
older stores are ignored on reading, and a missing, truncated or invalid manifest is reported as
a ``StoreError`` that names the file.

Every manifest lists the artefact's files (``Manifest.files``: path relative to the folder ->
sha256, size in bytes and mtime in ns at commit), filled in by ``graphstore.atomic.commit_directory``
(``graphstore.integrity.folder_digests``) and checked by ``graphstore.integrity``. Manifests
written before checksums were recorded have ``files = None``: readable, but unverifiable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from graphstore.errors import StoreError
from graphstore.layout import DATASET_FILES, LINK_PAIRS, MANIFEST


def utc_now() -> str:
    """ISO time with microseconds, so versions written within one second still sort by age."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


class FileDigest(BaseModel):
    """One file of an artefact as it was committed."""

    model_config = ConfigDict(extra="ignore")

    sha256: str  # hex digest of the file's bytes
    size: int  # bytes
    mtime_ns: int  # modification time (ns since the epoch): with ``size``, the cheap change detector


class Manifest(BaseModel):
    """Fields every manifest has.

    ``files``: relative path (``/``-separated) -> ``FileDigest`` of every file the artefact consists
    of (``graphstore.integrity.artefact_files``), None in manifests of older stores.
    """

    model_config = ConfigDict(extra="ignore")

    kind: str
    fp: str
    created_at: str = Field(default_factory=utc_now)
    files: dict[str, FileDigest] | None = None


class DatasetManifest(Manifest):
    """``datasets/name=<name>/fp=<fp>/``: nodes, edges and features of one dataset version."""

    kind: Literal["dataset"] = "dataset"
    format: int
    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    splits: dict[str, int] = {}
    extra_columns: list[str] = []
    source: dict[str, Any] = {}
    symmetric: bool = False
    self_loops: int = 0
    duplicates_removed: int = 0
    remote_nodes: int = 0  # a site's dataset: distinct edge sources held by other sites
    feature_format: Literal["dense", "sparse"] = "dense"
    features_nonnegative: bool = False  # no negative value (counts, TF-IDF): rows may be normalised
    task: Literal["node", "link"] = "node"  # link: a link split (graphstore.ingest.link_split) with its pairs
    link_pairs: dict[str, int] = {}  # link: train positives (the stored edges) and val / test positives and negatives

    @property
    def data_files(self) -> tuple[str, ...]:
        """The data files of the folder: the three tables, and a link dataset's pairs."""
        return DATASET_FILES + ((LINK_PAIRS,) if self.task == "link" else ())


class PartitionManifest(Manifest):
    """``partitions/dataset=<fp>/fp=<pfp>/``: the partition options (flat, as the SQL view reads
    them), sizes and per-part stats."""

    kind: Literal["partition"] = "partition"
    format: int
    dataset: str
    dataset_name: str
    method: str
    parts: int
    seed: int | None = None
    objective: str | None = None
    clusters: int | None = None
    column: str | None = None
    stable_from: str | None = None  # the anchor partition's fp (stable partitions), else None
    kept_nodes: int | None = None  # anchored only: anchor nodes still present in the same part
    moved_nodes: int | None = None  # anchored only: anchor nodes still present in another part
    new_nodes: int | None = None  # anchored only: nodes the anchor does not have
    removed_nodes: int | None = None  # anchored only: anchor nodes no longer in the dataset
    edge_cut: int
    halo_total: int
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    feature_format: Literal["dense", "sparse"] = "dense"
    features_nonnegative: bool = False
    assign_seconds: float = 0.0
    seconds: float = 0.0
    stats: list[dict[str, Any]] = []

    def options_payload(self) -> dict[str, Any]:
        """The method options this artefact was built with (the keys that are set), without the
        ``stable_from`` anchor: options rebuilt from them partition from scratch."""
        keys = ("method", "parts", "seed", "objective", "clusters", "column")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class LayerManifest(Manifest):
    """``runs/run=<rfp>/layer=<l>/``: one trained layer (model, per-part embeddings and byte logs)."""

    kind: Literal["layer"] = "layer"
    run: str
    layer: int
    parts: int
    strategy: str
    model: str
    last: bool
    options: dict[str, Any]
    best_round: int
    best_val: float
    rounds: int
    seconds: float
    dropped_parts: list[int] = []
    recipe: dict[str, Any] = {}  # what was chosen on validation and each candidate's val score
    reused_from: str | None = None
    platform: dict[str, Any] = {}  # where it trained: torch, device, cpu_capability, threads ({} in older stores)

    @property
    def platform_label(self) -> str:
        """``torch 2.13.0+cpu, cpu, AVX512, 1 thread`` ('' for a layer of an older store)."""
        p = self.platform
        if not p:
            return ""
        threads = f"{p['threads']} thread" + ("s" if p["threads"] != 1 else "")
        return f"torch {p['torch']}, {p['device']}, {p['cpu_capability']}, {threads}"


class LayerRef(BaseModel):
    """How a run's layer came to be."""

    layer: int
    fp: str
    reused_from: str | None = None


class RunManifest(Manifest):
    """``runs/run=<rfp>/``: a finished run's summary (written last, after every layer)."""

    kind: Literal["run"] = "run"
    dataset: str
    dataset_name: str
    partition: str | None
    method: str | None
    parts: int
    strategy: str
    model: str
    setting: str
    label: str
    config: dict[str, Any]
    network: dict[str, Any]
    test_acc: float | None
    val_acc: float | None
    train_acc: float | None
    evaluation: list[dict[str, Any]]
    total_bytes: int
    bytes_by_kind: dict[str, int]
    sim_comm_s: float
    wall_s: float
    layers: list[LayerRef]
    code_version: str
    status: str = "completed"
    site: int | None = None  # a run of sites: this site's rank (0 coordinates; world = parts)
    bytes_by_site: dict[str, int] = {}  # the coordinator of a run of sites: every site's bytes sent
    recipe: dict[str, Any] = {}  # {"layers": {"1": knob values, ...}}: what each layer trained with (recipe.json)
    platform: str = ""  # where its layers trained (LayerManifest.platform_label; several joined by "; ")

    def accuracy(self, split: str) -> float:
        return next(float(r["accuracy"]) for r in self.evaluation if r["split"] == split)

    def score_name(self, split: str) -> str:
        """``roc_auc`` for a link or two-class task (when computed), ``accuracy`` otherwise."""
        auc = next(r for r in self.evaluation if r["split"] == split).get("roc_auc")
        return "roc_auc" if auc is not None and auc == auc else "accuracy"

    def score(self, split: str) -> float:
        """The split's ROC-AUC for a link or two-class task (when computed), its accuracy otherwise."""
        row = next(r for r in self.evaluation if r["split"] == split)
        return float(row[self.score_name(split)])


AnyManifest = DatasetManifest | PartitionManifest | LayerManifest | RunManifest
KINDS: dict[str, type[Manifest]] = {
    "dataset": DatasetManifest, "partition": PartitionManifest, "layer": LayerManifest, "run": RunManifest,
}
M = TypeVar("M", bound=Manifest)


def _parse(path: Path) -> dict[str, Any]:
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"no manifest at {path}: the artefact does not exist or was never completed") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: corrupt manifest ({exc}); re-run the command that wrote it, or run "
                         "`retexo store verify --repair` to remove it so that it is rebuilt") from None
    if not isinstance(payload, dict):
        raise StoreError(f"{path}: corrupt manifest (expected a JSON object)")
    return payload


def read_manifest(directory: Path, model: type[M]) -> M:
    """The manifest of the artefact at ``directory`` as ``model``."""
    path = directory / MANIFEST
    try:
        return model.model_validate(_parse(path))
    except ValidationError as exc:
        problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
        raise StoreError(f"{path}: not a valid {model.__name__} ({problem})") from None


def read_any_manifest(directory: Path) -> Manifest:
    """The manifest at ``directory`` as the model of its ``kind``."""
    payload = _parse(directory / MANIFEST)
    model = KINDS.get(str(payload.get("kind")))
    if model is None:
        raise StoreError(f"{directory / MANIFEST}: unknown artefact kind {payload.get('kind')!r}")
    return read_manifest(directory, model)


def manifest_json(manifest: Manifest) -> str:
    """The file text of a manifest: sorted keys, NaN kept as JSON ``NaN`` (metrics may be undefined)."""
    payload = manifest.model_dump(mode="python")
    return json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n"
