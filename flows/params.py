"""Pipeline parameters: one pydantic model per stage, shared by YAML presets, the CLI and the flows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from graphstore.errors import ConfigError, describe_validation_error
from graphstore.ingest.spec import DatasetSpec
from graphstore.partition.methods import PartitionOptions
from graphstore.promotion import PromotionOptions
from retexo_core.config import Strategy
from runner.request import RunRequest, RunSettings

StoreField = RunSettings.model_fields["store"]  # declared once, with the run's other settings


class IngestParams(BaseModel):
    """``ingest_flow``: bring one dataset into the store."""

    model_config = ConfigDict(extra="forbid")

    store: str | None = StoreField
    dataset: DatasetSpec


class PartitionParams(BaseModel):
    """``partition_flow``: partition a stored dataset (name = newest version, or fingerprint)."""

    model_config = ConfigDict(extra="forbid")

    store: str | None = StoreField
    dataset: str
    partition: PartitionOptions = Field(default_factory=PartitionOptions)


class TrainingParams(RunSettings):
    """Where and how to partition and train (``runner.request.RunSettings``), and the retries of the
    train task (shared by ``RunParams`` and ``PipelineParams``)."""

    retries: int = Field(1, ge=0, description="Retries of a failed training task (resumes from the store)")
    retry_delay_s: float = Field(5.0, ge=0)


class RunParams(TrainingParams):
    """``train_flow``: one training run over a stored dataset: the fields of a ``RunRequest`` (as it
    declares them), but no site (sites train with ``retexo site train``), and the task's retries."""

    dataset: str = RunRequest.model_fields["dataset"]
    cold_start_if_unfit: bool = RunRequest.model_fields["cold_start_if_unfit"]

    def request(self) -> RunRequest:
        return RunRequest.model_validate(self.model_dump(include=set(RunRequest.model_fields)))


class PipelineParams(TrainingParams):
    """The whole job: dataset -> partition -> train -> evaluate (a preset in ``configs/``).

    With ``preset`` (a YAML file, relative to the working directory) the preset is loaded first
    and the other fields given here override it, key by key. ``promotion.pipeline`` turns on the
    promotion gate (``tasks.promote``).
    """

    preset: str | None = None
    dataset: DatasetSpec | None = Field(None, description="Required, here or in the preset")
    promotion: PromotionOptions = Field(default_factory=PromotionOptions)
    compare: list[Strategy] = Field(
        default_factory=list, description="Baseline strategies trained after the run with the same partition, "
        "model, sizes and seed (each with its own defaults for the rest), for the accuracy-vs-bytes comparison")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset"):
            preset = read_tree(Path(data["preset"]))
            return merge(preset, data)
        return data

    @model_validator(mode="after")
    def _has_dataset(self) -> "PipelineParams":
        if self.dataset is None:
            raise ValueError("dataset is required (give it here or in the preset)")
        if self.train.strategy in self.compare:
            raise ValueError(f"compare lists {self.train.strategy}, the strategy of the run itself")
        return self

    def run_params(self, dataset: str) -> RunParams:
        return RunParams(dataset=dataset, **self.model_dump(include=set(TrainingParams.model_fields)))


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in ``override`` replaces ``base``."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _set(tree: dict[str, Any], dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{key}' is not a section")
    node[keys[-1]] = yaml.safe_load(raw)


def _resolve_paths(tree: dict[str, Any], base: Path) -> None:
    dataset = tree.get("dataset")
    if isinstance(dataset, dict):
        for key in ("path", "edges", "nodes", "features"):
            value = dataset.get(key)
            if isinstance(value, str) and not Path(value).is_absolute():
                dataset[key] = str((base / value).resolve())


def read_tree(path: Path) -> dict[str, Any]:
    """A preset as a plain mapping, dataset paths resolved against the preset's folder."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping with dataset / partition / train / network")
    _resolve_paths(tree, path.resolve().parent)
    return tree


def load_params(path: Path, overrides: list[str] | None = None) -> PipelineParams:
    """Read a YAML preset, apply ``key.sub=value`` overrides, validate (errors name the key)."""
    tree = read_tree(path)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.rounds=50")
        key, value = item.split("=", 1)
        _set(tree, key.strip(), value)
    try:
        return PipelineParams.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, f"{path}: invalid configuration")) from None
