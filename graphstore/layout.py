"""Where things live in the store (docs/store.md).

::

    datasets/name=<name>/fp=<fp>/{nodes,edges,features}.parquet + manifest.json (+ link_pairs.parquet)
    partitions/dataset=<fp>/fp=<pfp>/{assignment,stats}.parquet + manifest.json
    partitions/dataset=<fp>/fp=<pfp>/part=<i>/{nodes,edges,halo}.parquet (+ pairs.parquet)
    runs/run=<rfp>/layer=<l>/part=<i>/embeddings.parquet
    runs/run=<rfp>/layer=<l>/{model.pt, manifest.json}
    runs/run=<rfp>/{metrics,comm}.parquet + manifest.json
    catalog.duckdb
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Names that become folder names (datasets, pipelines): ASCII letters, digits, ``_ . -``, starting
# with a letter or digit, at most 100 characters (a path component may hold 255 bytes).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
NAME_RULE = "1 to 100 characters: letters, digits, - _ . (starting with a letter or digit)"
DEFAULT_STORE = "retexo-store"
STORE_ENV = "RETEXO_STORE"
MANIFEST = "manifest.json"
DATASET_FILES = ("nodes.parquet", "edges.parquet", "features.parquet")  # of every dataset folder
LINK_PAIRS = "link_pairs.parquet"  # a link dataset's evaluation pairs: src, dst, label, split
PART_PAIRS = "pairs.parquet"  # a link partition's part: the pairs whose dst the part owns, with the src's owner
TMP_PREFIX = ".tmp-"
UNKNOWN_OWNER = -1  # a halo row's owner in a site partition: found when the sites meet, never stored


def resolve_store_root(path: str | os.PathLike[str] | None = None) -> Path:
    """The store root: ``path`` if given, else ``$RETEXO_STORE``, else ``./retexo-store``."""
    chosen = path or os.environ.get(STORE_ENV) or DEFAULT_STORE
    return Path(chosen).expanduser().resolve()


@dataclass(frozen=True)
class Store:
    """Paths of every artefact kind under one store root. Creating it creates the root."""

    root: Path

    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None) -> "Store":
        root = resolve_store_root(path)
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    @property
    def catalog_path(self) -> Path:
        return self.root / "catalog.duckdb"

    @property
    def lock_dir(self) -> Path:
        return self.root / ".locks"

    def datasets_dir(self) -> Path:
        return self.root / "datasets"

    def dataset_dir(self, name: str, fp: str) -> Path:
        return self.root / "datasets" / f"name={name}" / f"fp={fp}"

    def partition_dir(self, dataset_fp: str, partition_fp: str) -> Path:
        return self.root / "partitions" / f"dataset={dataset_fp}" / f"fp={partition_fp}"

    def part_dir(self, dataset_fp: str, partition_fp: str, part: int) -> Path:
        return self.partition_dir(dataset_fp, partition_fp) / f"part={part}"

    def run_dir(self, run_fp: str) -> Path:
        return self.root / "runs" / f"run={run_fp}"

    def layer_dir(self, run_fp: str, layer: int) -> Path:
        return self.run_dir(run_fp) / f"layer={layer}"

    def embeddings_path(self, run_fp: str, layer: int, part: int) -> Path:
        return self.layer_dir(run_fp, layer) / f"part={part}" / "embeddings.parquet"


def is_valid_name(name: str) -> bool:
    """True when ``name`` may become a folder name of the store (``NAME_PATTERN``)."""
    return re.fullmatch(NAME_PATTERN, name) is not None


def is_complete(directory: Path) -> bool:
    """An artefact folder exists for readers only once its manifest is written."""
    return (directory / MANIFEST).is_file()
