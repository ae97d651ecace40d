"""Graphs stored as a numpy ``.npz`` archive, in one of two published layouts.

- **heterophilous-graphs** (Platonov et al., ICLR 2023: actor, chameleon_filtered, minesweeper,
  roman-empire, tolokers, ...): ``node_features`` (N, F), ``node_labels`` (N,), ``edges`` (E, 2)
  with each undirected edge once, and optionally ``train_masks`` / ``val_masks`` / ``test_masks``,
  (S, N) bool for S official splits or (N,) for one.
- **gnn-benchmark** (Shchur et al. 2018: Amazon Computers/Photo, Coauthor CS/Physics, Cora-full,
  ...): the adjacency as CSR ``adj_data`` / ``adj_indices`` / ``adj_indptr`` / ``adj_shape`` (not
  necessarily symmetric), features as CSR ``attr_*`` or a dense ``attr_matrix``, and ``labels``
  (N,) or a one-hot CSR ``labels_*``; no split.

The file is an ``.npz`` or a ``.zip`` holding exactly one ``.npz`` member (read into memory, never
extracted to disk). Nothing is unpickled: only the keys a layout needs are read, each with
``allow_pickle=False`` (a key holding Python objects, such as gnn-benchmark's ``class_names``, is
refused if needed and otherwise never read). Array headers are read before any data, so the
memory estimate of an ingest (``npz_estimate``) costs nothing.

Node ids are the row positions 0..N-1. Edges are the ``edges`` rows, or the adjacency's non-zero
entries (weights are ignored). Features keep the file's values (cast to float32, never
normalised); for ``auto`` storage the density rule of ``graphstore.ingest.features`` applies to
the gnn-benchmark CSR matrices too, because that repository stores every matrix CSR whatever its
density (Amazon Computers' features are 35 % non-zero): a CSR matrix denser than
``SPARSE_DENSITY`` is stored dense. Nodes that the chosen official split leaves out of every mask
get the split ``none``.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from graphstore.errors import InputError
from graphstore.ingest.features import SPARSE_DENSITY, RequestedFormat, density
from graphstore.ingest.graph import SourceGraph
from graphstore.limits import Estimate, tables_estimate

if TYPE_CHECKING:
    import scipy.sparse

    from graphstore.parquet_io import FeatureMatrix

Layout = Literal["heterophilous-graphs", "gnn-benchmark"]
HETEROPHILOUS_KEYS = ("node_features", "node_labels", "edges")
MASK_KEYS = ("train_masks", "val_masks", "test_masks")
SPLIT_OF_MASK = {"train_masks": "train", "val_masks": "val", "test_masks": "test"}
CSR_PARTS = ("data", "indices", "indptr", "shape")
ADJ_KEYS = tuple(f"adj_{part}" for part in CSR_PARTS)
# what reading a damaged archive or member raises (bad CRC, truncated data, a malformed header)
READ_ERRORS = (ValueError, OSError, EOFError, SyntaxError, zipfile.BadZipFile, zlib.error)
EXPECTED = (f"{', '.join(HETEROPHILOUS_KEYS)} (heterophilous-graphs layout) or {', '.join(ADJ_KEYS)}, attr_*, "
            "labels (gnn-benchmark layout)")


class NpzArrays:
    """The arrays of one ``.npz``: a zip archive of ``.npy`` members, one per key.

    ``file`` names the source in error messages (``path``, or ``path (member)`` for an ``.npz``
    inside a ``.zip``); ``held_bytes`` is what opening it keeps in memory (a nested member).
    """

    def __init__(self, path: Path):
        if not path.is_file():
            raise InputError(str(path), "file does not exist")
        self.file = str(path)
        self.held_bytes = 0
        self._archive = self._open_zip(path)
        inner = [m for m in self._archive.namelist() if m.lower().endswith(".npz")]
        if inner:
            if len(inner) != 1:
                self.close()
                raise InputError(self.file, f"the zip holds {len(inner)} .npz members ({', '.join(inner)}): "
                                            "expected exactly one")
            self.file = f"{path} ({inner[0]})"
            self.held_bytes = self._archive.getinfo(inner[0]).file_size
            try:
                data = self._archive.read(inner[0])
            except READ_ERRORS as exc:
                raise InputError(self.file, f"cannot read the member ({exc})") from exc
            finally:
                self._archive.close()
            self._archive = self._open_zip(io.BytesIO(data))
        self._members = {m.removesuffix(".npy"): m for m in self._archive.namelist() if m.endswith(".npy")}
        if not self._members:
            self.close()
            raise InputError(self.file, f"holds no .npy arrays and no .npz member: expected an .npz file with keys "
                                        f"{EXPECTED}, or a .zip holding one .npz")

    def _open_zip(self, source: Path | io.BytesIO) -> zipfile.ZipFile:
        try:
            return zipfile.ZipFile(source)
        except (zipfile.BadZipFile, OSError) as exc:
            raise InputError(self.file, f"not an .npz file (an .npz is a zip archive of .npy arrays) nor a .zip "
                                        f"holding one ({exc})") from exc

    def __enter__(self) -> "NpzArrays":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._archive.close()

    @property
    def keys(self) -> list[str]:
        return list(self._members)

    def require(self, *keys: str) -> None:
        """Refuse the file when any of ``keys`` is missing, naming the first and the keys found."""
        missing = [key for key in keys if key not in self._members]
        if missing:
            raise InputError(self.file, f"missing key '{missing[0]}' (keys found: {', '.join(self.keys)})")

    def header(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        """(shape, dtype) of ``key`` from its ``.npy`` header, without reading its data."""
        self.require(key)
        with self._archive.open(self._members[key]) as member:
            try:
                version = np.lib.format.read_magic(member)
                if version == (1, 0):
                    shape, _fortran, dtype = np.lib.format.read_array_header_1_0(member)
                else:
                    shape, _fortran, dtype = np.lib.format.read_array_header_2_0(member)
            except READ_ERRORS as exc:
                raise InputError(self.file, f"key '{key}': not a readable .npy array ({exc})") from exc
        return tuple(shape), dtype

    def read(self, key: str) -> np.ndarray:
        """The array ``key``; an array of Python objects is refused (it would need unpickling), and so
        is one whose header promises more bytes than its member holds (nothing is allocated for it)."""
        shape, dtype = self.header(key)
        if dtype.hasobject:
            raise InputError(self.file, f"key '{key}' holds Python objects, which would need unpickling: "
                                        "expected a numeric array")
        size = self._archive.getinfo(self._members[key]).file_size
        if _nbytes(shape, dtype) > size:
            raise InputError(self.file, f"key '{key}': the header promises {shape} {dtype} values "
                                        f"({_nbytes(shape, dtype):,} bytes), the member holds {size:,} bytes")
        with self._archive.open(self._members[key]) as member:
            try:
                return np.lib.format.read_array(member, allow_pickle=False)
            except READ_ERRORS as exc:
                raise InputError(self.file, f"key '{key}': not a readable .npy array ({exc})") from exc


def layout_of(arrays: NpzArrays) -> Layout:
    """Which layout the keys follow (gnn-benchmark when any ``adj_*`` key is present)."""
    if any(key.startswith("adj_") for key in arrays.keys):
        return "gnn-benchmark"
    if any(key in arrays.keys for key in (*HETEROPHILOUS_KEYS, *MASK_KEYS)):
        return "heterophilous-graphs"
    raise InputError(arrays.file, f"not a known graph layout: expected keys {EXPECTED}; found {', '.join(arrays.keys)}")


def split_count(arrays: NpzArrays) -> int:
    """How many official splits the file holds: the masks' first dimension (1 for 1-D masks), 0 if none."""
    if layout_of(arrays) != "heterophilous-graphs" or not any(key in arrays.keys for key in MASK_KEYS):
        return 0
    arrays.require(*MASK_KEYS)
    shape, _ = arrays.header(MASK_KEYS[0])
    return 1 if len(shape) == 1 else int(shape[0])


def resolve_split_index(arrays: NpzArrays, requested: int | None) -> int | None:
    """The official split to use (``requested``, default 0), or None for a file without splits."""
    count = split_count(arrays)
    if count == 0:
        if requested is not None:
            raise InputError(arrays.file, f"--split-index {requested}: the file has no split masks "
                                          f"({', '.join(MASK_KEYS)}); use --train-frac / --val-frac / --split-seed")
        return None
    index = 0 if requested is None else requested
    if not 0 <= index < count:
        raise InputError(arrays.file, f"key '{MASK_KEYS[0]}': --split-index {index} is out of range: the file has "
                                      f"{count} split(s), expected 0..{count - 1}")
    return index


# --------------------------------------------------------------------------- memory


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.float64)) * dtype.itemsize


def _rows(shape: tuple[int, ...]) -> int:
    return int(shape[0]) if shape else 0


def npz_estimate(arrays: NpzArrays, undirected: bool, requested: RequestedFormat) -> Estimate:
    """Peak memory of ingesting ``arrays``, from the array headers alone.

    The edges and nodes are costed as a table ingest's (``limits.tables_estimate``); the feature
    bytes are the arrays as read plus two copies of the stored matrix (float32 cast, row order),
    N x F x 4 when stored dense, non-zeros x 8 when sparse; plus a nested member held in memory.
    """
    if layout_of(arrays) == "heterophilous-graphs":
        arrays.require(*HETEROPHILOUS_KEYS)
        shape, dtype = arrays.header("node_features")
        nodes, edges = _rows(shape), _rows(arrays.header("edges")[0])
        read, stored = _nbytes(shape, dtype), _nbytes(shape, np.dtype(np.float32))  # sparse is smaller
    else:
        arrays.require(*ADJ_KEYS)
        nodes, edges = _rows(arrays.header("adj_indptr")[0]) - 1, _rows(arrays.header("adj_indices")[0])
        if "attr_matrix" in arrays.keys:
            shape, dtype = arrays.header("attr_matrix")
            read, stored = _nbytes(shape, dtype), _nbytes(shape, np.dtype(np.float32))
        else:
            arrays.require("attr_indices", "attr_shape")
            read = sum(_nbytes(*arrays.header(f"attr_{part}")) for part in ("data", "indices", "indptr"))
            entries, cells = _rows(arrays.header("attr_indices")[0]), float(np.prod(arrays.read("attr_shape")))
            sparse = requested == "sparse" or (requested == "auto" and entries <= SPARSE_DENSITY * cells)
            stored = entries * 8 if sparse else int(cells) * 4
    return tables_estimate(edges, nodes, read + 2 * stored + arrays.held_bytes, undirected)


# --------------------------------------------------------------------------- checks


def _integers(arrays: NpzArrays, key: str, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind not in "iu":
        raise InputError(arrays.file, f"key '{key}': expected integers, found dtype {values.dtype}")
    return values.astype(np.int64)


def _expect_shape(arrays: NpzArrays, key: str, shape: tuple[int, ...], expected: tuple[int | None, ...],
                  meaning: str) -> None:
    """Refuse ``key`` unless its ``shape`` matches ``expected`` (None: any length)."""
    if len(shape) != len(expected) or any(e is not None and s != e for s, e in zip(shape, expected)):
        shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ("," * (len(expected) == 1)) + ")"
        raise InputError(arrays.file, f"key '{key}': expected shape {shown} ({meaning}), found {tuple(shape)}")


def _labels(arrays: NpzArrays, key: str, num_nodes: int) -> tuple[np.ndarray, int]:
    """(N,) int64 labels (-1 unknown) and the class count (largest label + 1)."""
    label = _integers(arrays, key, arrays.read(key))
    _expect_shape(arrays, key, label.shape, (num_nodes,), "one label per node")
    bad = label < -1
    if bad.any():
        node = int(np.argmax(bad))
        raise InputError(arrays.file, f"key '{key}': {key}[{node}] = {label[node]} is out of range: expected -1 "
                                      "(unknown) or a class id >= 0")
    return label, int(max(label.max(initial=-1), -1) + 1)


def _finite_features(arrays: NpzArrays, key: str, x: "FeatureMatrix") -> None:
    values = x if isinstance(x, np.ndarray) else x.data
    if values.dtype.kind not in "biuf":
        raise InputError(arrays.file, f"key '{key}': expected numbers, found dtype {values.dtype}")
    finite = np.isfinite(values)
    if finite.all():
        return
    if isinstance(x, np.ndarray):
        node, column = (int(i) for i in np.argwhere(~finite)[0])
    else:
        entry = int(np.argmax(~finite))
        node, column = int(np.searchsorted(x.indptr, entry, side="right")) - 1, int(x.indices[entry])
    raise InputError(arrays.file, f"key '{key}': the value of node {node}, feature {column} is not finite")


def _csr(arrays: NpzArrays, prefix: str, num_rows: int, meaning: str) -> "scipy.sparse.csr_matrix":
    """The CSR matrix of keys ``<prefix>_data/indices/indptr/shape`` with ``num_rows`` rows, checked
    part by part."""
    import scipy.sparse as sp  # imported here: it adds ~0.15 s to every CLI start

    keys = {part: f"{prefix}_{part}" for part in CSR_PARTS}
    arrays.require(*keys.values())
    shape = _integers(arrays, keys["shape"], arrays.read(keys["shape"]))
    _expect_shape(arrays, keys["shape"], shape.shape, (2,), f"rows and columns of {meaning}")
    rows, columns = (int(v) for v in shape)
    if rows != num_rows or columns < 0:
        raise InputError(arrays.file, f"key '{keys['shape']}': expected ({num_rows}, *) ({meaning}), "
                                      f"found ({rows}, {columns})")
    indptr = _integers(arrays, keys["indptr"], arrays.read(keys["indptr"]))
    _expect_shape(arrays, keys["indptr"], indptr.shape, (rows + 1,), "rows + 1 offsets")
    indices = _integers(arrays, keys["indices"], arrays.read(keys["indices"]))
    _expect_shape(arrays, keys["indices"], indices.shape, (None,), "one column id per stored entry")
    data = arrays.read(keys["data"])
    _expect_shape(arrays, keys["data"], data.shape, (len(indices),), f"one value per entry of {keys['indices']}")
    if data.dtype.kind not in "biuf":
        raise InputError(arrays.file, f"key '{keys['data']}': expected numbers, found dtype {data.dtype}")
    if indptr[0] != 0 or indptr[-1] != len(indices) or (np.diff(indptr) < 0).any():
        raise InputError(arrays.file, f"key '{keys['indptr']}': expected non-decreasing offsets from 0 to "
                                      f"{len(indices)} (the length of {keys['indices']})")
    outside = (indices < 0) | (indices >= columns)
    if outside.any():
        entry = int(np.argmax(outside))
        raise InputError(arrays.file, f"key '{keys['indices']}': {keys['indices']}[{entry}] = {indices[entry]} is out "
                                      f"of range: expected column ids 0..{columns - 1} ({keys['shape']})")
    return sp.csr_matrix((data, indices, indptr), shape=(rows, columns))


def _edges(arrays: NpzArrays, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    edges = _integers(arrays, "edges", arrays.read("edges"))
    _expect_shape(arrays, "edges", edges.shape, (None, 2), "one (source, target) pair per row")
    outside = (edges < 0) | (edges >= num_nodes)
    if outside.any():
        row = int(np.argmax(outside.any(axis=1)))
        raise InputError(arrays.file, f"key 'edges': edges[{row}] = {edges[row].tolist()} is out of range: expected "
                                      f"node ids 0..{num_nodes - 1} (the rows of node_features)")
    return edges[:, 0].copy(), edges[:, 1].copy()


def _official_split(arrays: NpzArrays, index: int, label: np.ndarray) -> np.ndarray:
    """(N,) split names from row ``index`` of the three masks; nodes in no mask get ``none``."""
    first = arrays.header(MASK_KEYS[0])[0]
    _expect_shape(arrays, MASK_KEYS[0], first, (len(label),) if len(first) == 1 else (None, len(label)),
                  "one flag per node, in each split")
    split = np.full(len(label), "none", dtype="<U5")
    for key in MASK_KEYS:
        _expect_shape(arrays, key, arrays.header(key)[0], first, f"the shape of {MASK_KEYS[0]}")
        mask = arrays.read(key)
        if mask.dtype != np.bool_ and not (mask.dtype.kind in "iu" and np.isin(mask, (0, 1)).all()):
            raise InputError(arrays.file, f"key '{key}': expected a boolean mask, found dtype {mask.dtype}")
        row = (mask if mask.ndim == 1 else mask[index]).astype(bool)
        taken = row & (split != "none")
        if taken.any():
            node = int(np.argmax(taken))
            raise InputError(arrays.file, f"key '{key}': node {node} is also in {split[node]}_masks in split {index}: "
                                          "expected each node in at most one mask")
        unlabelled = row & (label < 0)
        if unlabelled.any():
            raise InputError(arrays.file, f"key '{key}': node {int(np.argmax(unlabelled))} is in the mask of split "
                                          f"{index} but has no label (-1)")
        split[row] = SPLIT_OF_MASK[key]
    return split


def _stored_layout(x: "FeatureMatrix", requested: RequestedFormat) -> "FeatureMatrix":
    """A CSR matrix denser than ``SPARSE_DENSITY`` densified for ``auto`` (module docstring)."""
    if requested == "auto" and not isinstance(x, np.ndarray) and density(x) > SPARSE_DENSITY:
        return x.toarray()
    return x


# --------------------------------------------------------------------------- loading


def _load_heterophilous(arrays: NpzArrays, split_index: int | None) -> SourceGraph:
    arrays.require(*HETEROPHILOUS_KEYS)
    x = arrays.read("node_features")
    _expect_shape(arrays, "node_features", x.shape, (None, None), "one feature row per node")
    _finite_features(arrays, "node_features", x)
    label, num_classes = _labels(arrays, "node_labels", x.shape[0])
    src, dst = _edges(arrays, x.shape[0])
    split = None if split_index is None else _official_split(arrays, split_index, label)
    return SourceGraph(node_id=np.arange(x.shape[0], dtype=np.int64), label=label, split=split,
                       x=x.astype(np.float32, copy=False), src=src, dst=dst, num_classes=num_classes)


def _load_gnn_benchmark(arrays: NpzArrays) -> SourceGraph:
    arrays.require(*ADJ_KEYS)
    shape = _integers(arrays, "adj_shape", arrays.read("adj_shape"))
    if shape.shape != (2,) or shape[0] != shape[1]:
        raise InputError(arrays.file, f"key 'adj_shape': expected (N, N) (a square adjacency matrix), "
                                      f"found {shape.tolist()}")
    num_nodes = int(shape[0])
    adjacency = _csr(arrays, "adj", num_nodes, "the adjacency matrix").tocoo()
    if "attr_matrix" in arrays.keys:
        x = arrays.read("attr_matrix")
        _expect_shape(arrays, "attr_matrix", x.shape, (num_nodes, None), "one feature row per node of adj_shape")
        _finite_features(arrays, "attr_matrix", x)
        x = x.astype(np.float32, copy=False)
    else:
        x = _csr(arrays, "attr", num_nodes, "one feature row per node of adj_shape")
        _finite_features(arrays, "attr_data", x)
        x = x.astype(np.float32)
    if "labels" in arrays.keys or not any(key.startswith("labels_") for key in arrays.keys):
        label, num_classes = _labels(arrays, "labels", num_nodes)
    else:
        onehot = _csr(arrays, "labels", num_nodes, "one row of class flags per node of adj_shape")
        onehot.eliminate_zeros()
        per_node = np.diff(onehot.indptr)
        if (per_node > 1).any():
            node = int(np.argmax(per_node > 1))
            raise InputError(arrays.file, f"key 'labels_indices': node {node} has {per_node[node]} labels: multi-label "
                                          "data is not supported (expected at most one class per node)")
        label = np.full(num_nodes, -1, np.int64)
        label[per_node == 1] = onehot.indices
        num_classes = onehot.shape[1]
    edge = adjacency.data != 0
    return SourceGraph(node_id=np.arange(num_nodes, dtype=np.int64), label=label, split=None, x=x,
                       src=adjacency.row[edge].astype(np.int64), dst=adjacency.col[edge].astype(np.int64),
                       num_classes=num_classes)


def load_npz(arrays: NpzArrays, split_index: int | None, undirected: bool, requested: RequestedFormat) -> SourceGraph:
    """The graph of ``arrays`` (``split_index`` from ``resolve_split_index``: None draws a split later)."""
    if layout_of(arrays) == "heterophilous-graphs":
        graph = _load_heterophilous(arrays, split_index)
    else:
        graph = _load_gnn_benchmark(arrays)
    graph.x = _stored_layout(graph.x, requested)
    graph.undirected = undirected
    graph.files = {"nodes": arrays.file, "edges": arrays.file, "features": arrays.file}
    return graph
