"""A declarative description of where a dataset comes from (used by presets and flows)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphstore.ingest.api import ingest_ogb, ingest_planetoid, ingest_synthetic, ingest_tables
from graphstore.ingest.features import RequestedFormat
from graphstore.ingest.link_split import LinkSplitOptions, split_links
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.synthetic import SyntheticOptions
from graphstore.ingest.tables import TableOptions, find_table_files
from graphstore.layout import Store
from graphstore.lookup import DatasetRef, find_dataset


class DatasetSpec(BaseModel):
    """Where the graph comes from. ``source: store`` uses a dataset already ingested under ``name``;
    ``source: tables`` with ``path`` reads a folder's ``edges``, ``nodes`` and optional ``features``
    files (a changing export: each content change is a new dataset version).

    Relative paths in a preset are resolved against the folder of the YAML file.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    source: Literal["store", "planetoid", "ogb", "tables", "synthetic"] = "store"
    path: str | None = None  # planetoid / ogb folder; tables: an export folder with edges.*, nodes.*, features.*
    edges: str | None = None  # tables (instead of path)
    nodes: str | None = None
    features: str | None = None
    tables: TableOptions = Field(default_factory=TableOptions)
    undirected: bool = False  # ogb: add reverse edges
    feature_format: RequestedFormat = "auto"  # planetoid / ogb (tables: tables.feature_format)
    synthetic: SyntheticOptions | None = None
    split: SplitFractions = Field(default_factory=SplitFractions)
    force: bool = False  # tables / synthetic: ingest even when the memory estimate exceeds the available memory
    link_split: LinkSplitOptions | None = Field(
        None, description="Derive the link dataset '<name>_link' from each ingested version (held-out edges and "
        "pairs: `retexo ingest link-split`), for `train.task: link`")

    @model_validator(mode="after")
    def _complete(self) -> "DatasetSpec":
        needs = {"planetoid": ["path"], "ogb": ["path"], "tables": ["edges", "nodes"], "synthetic": ["synthetic"]}
        if self.source == "tables" and self.path is not None:
            if self.edges or self.nodes or self.features:
                raise ValueError("source 'tables' takes either path (a folder) or edges / nodes / features files")
            return self
        missing = [key for key in needs.get(self.source, []) if getattr(self, key) is None]
        if missing:
            raise ValueError(f"source '{self.source}' needs {', '.join(missing)}")
        return self


def ingest_source(store: Store, spec: DatasetSpec) -> DatasetRef:
    """Ingest ``spec`` (a no-op when the store already has this fingerprint); with ``link_split``
    the link dataset derived from it."""
    ref = ingested(store, spec)
    if spec.link_split is None:
        return ref
    return split_links(store, ref, f"{spec.name}_link", spec.link_split)


def ingested(store: Store, spec: DatasetSpec) -> DatasetRef:
    if spec.source == "store":
        return find_dataset(store, spec.name)
    if spec.source == "planetoid":
        return ingest_planetoid(store, Path(spec.path), spec.name, spec.feature_format)  # type: ignore[arg-type]
    if spec.source == "ogb":
        return ingest_ogb(store, Path(spec.path), spec.name, spec.undirected, spec.feature_format)  # type: ignore[arg-type]
    if spec.source == "tables":
        if spec.path is not None:
            edges, nodes, features = find_table_files(Path(spec.path))
        else:
            edges, nodes = Path(spec.edges), Path(spec.nodes)  # type: ignore[arg-type]
            features = Path(spec.features) if spec.features else None
        return ingest_tables(store, spec.name, edges, nodes, features, spec.tables, spec.split, spec.force)
    return ingest_synthetic(store, spec.name, spec.synthetic, spec.split, force=spec.force)  # type: ignore[arg-type]
