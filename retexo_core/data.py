"""Per-partition data: what worker i reads from ``part=i`` of a partition, and nothing else.

Local node order: the n owned nodes (sorted by node id) first, then the h halo nodes grouped by
owner (and sorted by id within an owner). Every edge has its destination among the owned nodes.

Features come in the dataset's layout (the manifests' ``feature_format``): a dense float32 tensor,
or a :class:`retexo_core.sparse.SparseMatrix` for sparse (bag-of-words) datasets, never densified.

The files are hashed against the sha256 checksums of the manifest that lists them before they are
read (``graphstore.integrity.verify_files``; the manifest is parsed once per process): a file
changed after it was written is a ``StoreError`` naming it, never silently trained on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from graphstore.integrity import cached_manifest, verify_files
from graphstore.layout import LINK_PAIRS, PART_PAIRS
from graphstore.manifests import DatasetManifest, PartitionManifest
from graphstore.parquet_io import feature_columns, features_of, read_table
from retexo_core.sparse import SparseMatrix

SPLIT_NAMES = ("train", "val", "test")
PAIR_SPLITS = ("val", "test")


@dataclass
class LinkPairs:
    """The evaluation pairs a partition scores (a link dataset's pairs whose target it owns).

    src_id: (p,) int64 ids of the pairs' sources (owned or remote).
    src_owner: (p,) int64 the part owning each source.
    dst: (p,) int64 local positions of the targets among the owned nodes.
    label: (p,) float32 1 for a held-out edge, 0 for a negative pair.
    split: (p,) object ``val`` or ``test``.
    """

    src_id: np.ndarray
    src_owner: np.ndarray
    dst: np.ndarray
    label: torch.Tensor
    split: np.ndarray

    @classmethod
    def from_table(cls, table: pa.Table, owned: np.ndarray, src_owner: np.ndarray | None = None) -> "LinkPairs":
        """From ``src, dst, label, split`` (and ``src_owner``, unless given) rows whose dst ``owned`` holds."""
        owner = table.column("src_owner").to_numpy() if src_owner is None else src_owner
        return cls(table.column("src").to_numpy(), owner, np.searchsorted(owned, table.column("dst").to_numpy()),
                   torch.from_numpy(table.column("label").to_numpy().astype(np.float32)),
                   table.column("split").to_numpy(zero_copy_only=False))


@dataclass
class PartData:
    """One partition's view of the graph.

    Attributes:
        part, num_parts: this partition's index and K.
        node_id: (n,) int64 ids of owned nodes.
        x: (n, F) owned features, F = the manifest's ``num_features``: a float32
            ``torch.Tensor`` for dense datasets, a float32 :class:`SparseMatrix` (CSR, column ids
            sorted within each row, no explicit zeros) for sparse ones; row i belongs to
            ``node_id[i]`` either way.
        y: (n,) int64 labels (-1 unknown).
        masks: split name -> (n,) bool.
        halo_id, halo_owner: (h,) int64 remote nodes this partition needs, grouped by owner.
        src, dst: (E,) int64 local positions (src in [0, n + h), dst in [0, n)).
        num_classes: number of classes.
        features_nonnegative: no feature value of the dataset is negative (counts, TF-IDF), as
            recorded at ingest for the whole dataset, so every partition decides alike.
        held_by_site: the part of a site that keeps its own store (``retexo_core.sites``): no
            per-node value may leave it beyond the strategy's halo rows.
        pairs: a link dataset's evaluation pairs this part scores (None for a node dataset).
    """

    part: int
    num_parts: int
    node_id: np.ndarray
    x: torch.Tensor | SparseMatrix
    y: torch.Tensor
    masks: dict[str, torch.Tensor]
    halo_id: np.ndarray
    halo_owner: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    num_classes: int
    features_nonnegative: bool = False
    held_by_site: bool = False
    pairs: LinkPairs | None = None

    @property
    def num_owned(self) -> int:
        return len(self.node_id)

    @property
    def num_halo(self) -> int:
        return len(self.halo_id)

    def to(self, device: torch.device) -> "PartData":
        """This partition with its features, labels and masks on ``device`` (ids, halo lists and
        edge positions stay NumPy arrays: they set up plans and graphs, on the CPU)."""
        if self.y.device == device:
            return self
        return dataclasses.replace(self, x=self.x.to(device), y=self.y.to(device),
                                   masks={name: mask.to(device) for name, mask in self.masks.items()})

    def halo_block(self, owner: int) -> slice:
        """Positions (within the halo, 0-based) of the halo nodes owned by ``owner``."""
        lo, hi = np.searchsorted(self.halo_owner, [owner, owner + 1])
        return slice(int(lo), int(hi))


def load_part(partition_dir: Path, part: int) -> PartData:
    """Read ``part=<part>/{nodes,edges,halo}.parquet`` (and the partition manifest) only, after
    hashing them against the manifest's checksums."""
    folder = partition_dir / f"part={part}"
    names = [f"part={part}/{name}.parquet" for name in ("nodes", "edges", "halo")]
    meta = verify_files(partition_dir, names, PartitionManifest)
    pairs_file = f"part={part}/{PART_PAIRS}"
    link = meta.files is not None and pairs_file in meta.files  # a link partition lists its pairs
    if link:
        verify_files(partition_dir, [pairs_file], PartitionManifest)
    nodes = read_table(folder / "nodes.parquet")
    edges = read_table(folder / "edges.parquet")
    halo = read_table(folder / "halo.parquet")
    node_id = nodes.column("node_id").to_numpy()
    split = nodes.column("split").to_numpy(zero_copy_only=False)
    halo_id, halo_owner = halo.column("node_id").to_numpy(), halo.column("owner").to_numpy()
    order = np.lexsort((halo_id, halo_owner))
    halo_id, halo_owner = halo_id[order], halo_owner[order]
    return PartData(
        part=part,
        num_parts=meta.parts,
        node_id=node_id,
        x=feature_tensor(nodes, meta.num_features),
        y=torch.from_numpy(nodes.column("label").to_numpy().astype(np.int64)),
        masks={name: torch.from_numpy(split == name) for name in SPLIT_NAMES},
        halo_id=halo_id,
        halo_owner=halo_owner,
        src=local_positions(node_id, halo_id, edges.column("src").to_numpy()),
        dst=np.searchsorted(node_id, edges.column("dst").to_numpy()),
        num_classes=meta.num_classes,
        features_nonnegative=meta.features_nonnegative,
        pairs=LinkPairs.from_table(read_table(folder / PART_PAIRS), node_id) if link else None,
    )


def feature_tensor(table: pa.Table, width: int) -> torch.Tensor | SparseMatrix:
    """The feature columns of ``table`` (either layout) as an (n, width) float32 tensor or SparseMatrix."""
    x = features_of(table, width)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return SparseMatrix.from_scipy(x)


def normalize_rows(x: torch.Tensor | SparseMatrix) -> torch.Tensor | SparseMatrix:
    """Each row divided by its sum (rows summing to 0 unchanged): bag-of-words counts become term
    frequencies, so that long and short documents weigh alike (Kipf & Welling's preprocessing)."""
    if isinstance(x, SparseMatrix):
        sums = torch.zeros(x.shape[0], dtype=x.val.dtype, device=x.device).index_add_(0, x.row_index(), x.val)
        sums[sums == 0] = 1
        return x.with_values(x.val / sums[x.row_index()])
    sums = x.sum(dim=1, keepdim=True)
    return x / torch.where(sums == 0, torch.ones_like(sums), sums)


def local_positions(owned: np.ndarray, halo: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Node ids -> local positions: owned (sorted) first, then halo in its (owner, id) order."""
    pos = np.searchsorted(owned, ids).clip(0, max(len(owned) - 1, 0))
    is_owned = owned[pos] == ids if len(owned) else np.zeros(len(ids), bool)
    halo_order = np.argsort(halo, kind="stable")
    halo_pos = halo_order[np.searchsorted(halo[halo_order], ids[~is_owned])]
    out = pos.astype(np.int64)
    out[~is_owned] = len(owned) + halo_pos
    return out


def load_whole_graph(dataset_dir: Path) -> PartData:
    """The whole dataset as a single partition (for centralized training): no halo. Its files (the
    three tables, and a link dataset's pairs) are hashed against the dataset manifest first."""
    manifest = verify_files(dataset_dir, cached_manifest(dataset_dir, DatasetManifest).data_files, DatasetManifest)
    link = manifest.task == "link"
    nodes = read_table(dataset_dir / "nodes.parquet", columns=["node_id", "label", "split"])
    features = read_table(dataset_dir / "features.parquet", columns=feature_columns(manifest.feature_format))
    edges = read_table(dataset_dir / "edges.parquet")
    node_id = nodes.column("node_id").to_numpy()
    split = nodes.column("split").to_numpy(zero_copy_only=False)
    return PartData(
        part=0,
        num_parts=1,
        node_id=node_id,
        x=feature_tensor(features, manifest.num_features),
        y=torch.from_numpy(nodes.column("label").to_numpy().astype(np.int64)),
        masks={name: torch.from_numpy(split == name) for name in SPLIT_NAMES},
        halo_id=np.empty(0, np.int64),
        halo_owner=np.empty(0, np.int64),
        src=np.searchsorted(node_id, edges.column("src").to_numpy()),
        dst=np.searchsorted(node_id, edges.column("dst").to_numpy()),
        num_classes=manifest.num_classes,
        features_nonnegative=manifest.features_nonnegative,
        pairs=whole_graph_pairs(dataset_dir, node_id) if link else None,
    )


def whole_graph_pairs(dataset_dir: Path, node_id: np.ndarray) -> LinkPairs:
    """Every pair of a link dataset, scored by the one part (which owns every source)."""
    table = read_table(dataset_dir / LINK_PAIRS)
    return LinkPairs.from_table(table, node_id, np.zeros(table.num_rows, np.int64))
