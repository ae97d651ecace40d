"""Parquet schemas and conversions between Arrow tables and numpy / scipy arrays.

Tables (docs/store.md):

- nodes: ``node_id int64, label int64 (-1 unknown), split string (train|val|test|none)``,
  sorted by ``node_id``; extra integer/string columns from the source are kept.
- edges: ``src int64, dst int64`` (directed; undirected graphs stored both ways).
- features: ``node_id int64`` plus the feature matrix (N rows, F columns), same order as nodes,
  in one of two layouts (the manifest's ``feature_format``; F is its ``num_features``):

  - ``dense``: ``x fixed_size_list<float32>[F]``, one row of F values per node;
  - ``sparse``: ``x_idx list<int32>`` (column ids of the row's stored entries, strictly
    increasing) and ``x_val list<float32>`` (their values, same lengths). Costs 8 bytes per
    stored entry instead of 4 bytes per cell.

  A partition's ``part=i/nodes.parquet`` carries its owned nodes' rows in the same layout.

scipy is imported inside the functions that need it (it adds ~0.15 s to every CLI start).

Reading goes through ``read_table`` (or ``parquet_errors``), so that a missing or corrupt file is a
``StoreError`` naming it, not a pyarrow message about ``'<Buffer>'``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from graphstore.errors import StoreError

if TYPE_CHECKING:
    import scipy.sparse

    FeatureMatrix = Union[np.ndarray, scipy.sparse.csr_matrix]

SPLITS = ("train", "val", "test", "none")
COMPRESSION = "zstd"

FeatureFormat = Literal["dense", "sparse"]
DENSE_COLUMN = "x"
SPARSE_COLUMNS = ("x_idx", "x_val")
MAX_CHUNK_ENTRIES = 2**31 - 1  # Arrow ``list`` offsets are int32: at most this many entries per chunk

EDGE_SCHEMA = pa.schema([("src", pa.int64()), ("dst", pa.int64())])


# --------------------------------------------------------------------------- dense


def features_array(x: np.ndarray) -> pa.FixedSizeListArray:
    """(N, F) float32 matrix -> Arrow fixed-size list array of length N."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def features_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Arrow fixed-size list column of length N -> (N, F) float32 matrix."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    width = column.type.list_size
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return np.array(flat, dtype=np.float32).reshape(len(column), width)  # writable copy


def features_table(node_id: np.ndarray, x: np.ndarray) -> pa.Table:
    """Dense layout: ``node_id`` (N,) and ``x`` (N, F) float32."""
    return pa.table({"node_id": pa.array(node_id, pa.int64()), DENSE_COLUMN: features_array(x)})


# --------------------------------------------------------------------------- sparse


def sparse_feature_columns(csr: "scipy.sparse.csr_matrix",
                           max_chunk_entries: int = MAX_CHUNK_ENTRIES) -> dict[str, pa.ChunkedArray]:
    """(N, F) CSR matrix -> ``{"x_idx": list<int32>, "x_val": list<float32>}`` columns of length N.

    Column ids are sorted and duplicates summed first (on a copy when needed), so every row's ids
    are strictly increasing. Rows are cut into chunks of at most ``max_chunk_entries`` entries
    (Arrow list offsets are int32); nothing of size F is allocated.
    """
    import scipy.sparse as sp

    if not sp.isspmatrix_csr(csr):
        csr = sp.csr_matrix(csr)
    if csr.shape[1] > np.iinfo(np.int32).max:
        raise ValueError(f"feature width {csr.shape[1]} does not fit int32 column ids")
    if not csr.has_canonical_format:
        csr = csr.copy()
        csr.sum_duplicates()
    indptr = csr.indptr.astype(np.int64, copy=False)
    indices = csr.indices.astype(np.int32, copy=False)
    data = csr.data.astype(np.float32, copy=False)
    idx_chunks, val_chunks = [], []
    for lo, hi in _row_chunks(indptr, max_chunk_entries):
        offsets = pa.array((indptr[lo:hi + 1] - indptr[lo]).astype(np.int32), pa.int32())
        entries = slice(int(indptr[lo]), int(indptr[hi]))
        idx_chunks.append(pa.ListArray.from_arrays(offsets, pa.array(indices[entries], pa.int32())))
        val_chunks.append(pa.ListArray.from_arrays(offsets, pa.array(data[entries], pa.float32())))
    return {
        SPARSE_COLUMNS[0]: pa.chunked_array(idx_chunks, pa.list_(pa.int32())),
        SPARSE_COLUMNS[1]: pa.chunked_array(val_chunks, pa.list_(pa.float32())),
    }


def _row_chunks(indptr: np.ndarray, max_entries: int) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) covering all rows (one empty range for no rows), each with at most
    ``max_entries`` entries. A single row with more entries than that raises ``ValueError``."""
    rows = len(indptr) - 1
    chunks, lo = [], 0
    while lo < rows or not chunks:
        hi = int(np.searchsorted(indptr, indptr[lo] + max_entries, side="right")) - 1
        hi = min(max(hi, lo), rows)
        if hi == lo and lo < rows:
            raise ValueError(f"row {lo} has more than {max_entries} stored entries")
        chunks.append((lo, hi))
        lo = hi
    return chunks


def sparse_features_table(node_id: np.ndarray, csr: "scipy.sparse.csr_matrix") -> pa.Table:
    """Sparse layout: ``node_id`` (N,), ``x_idx`` and ``x_val`` (N lists) of an (N, F) CSR matrix."""
    return pa.table({"node_id": pa.array(node_id, pa.int64()), **sparse_feature_columns(csr)})


def features_table_of(node_id: np.ndarray, x: "FeatureMatrix") -> pa.Table:
    """The features table of ``x`` in its own layout: dense for an ndarray, sparse for a CSR matrix."""
    return features_table(node_id, x) if isinstance(x, np.ndarray) else sparse_features_table(node_id, x)


# --------------------------------------------------------------------------- either layout


def feature_format_of(column_names: list[str] | pa.Schema) -> FeatureFormat:
    """Which layout a table (its column names or schema) holds; ``StoreError`` when neither."""
    names = set(column_names.names if isinstance(column_names, pa.Schema) else column_names)
    if DENSE_COLUMN in names:
        return "dense"
    if set(SPARSE_COLUMNS) <= names:
        return "sparse"
    raise StoreError(f"no feature columns: expected '{DENSE_COLUMN}' or {' and '.join(SPARSE_COLUMNS)}, "
                     f"found {', '.join(sorted(names))}")


def feature_columns(feature_format: FeatureFormat) -> list[str]:
    """The column names of ``feature_format``: ``["x"]`` or ``["x_idx", "x_val"]``."""
    return [DENSE_COLUMN] if feature_format == "dense" else list(SPARSE_COLUMNS)


def features_of(table: pa.Table, width: int) -> "FeatureMatrix":
    """The feature matrix of a table in either layout, with F = ``width`` columns (the manifest's
    ``num_features``).

    Returns an (N, F) float32 ndarray for the dense layout, a ``scipy.sparse.csr_matrix`` (N, F)
    float32 (int32 column ids sorted within each row) for the sparse one; both writable copies.
    Allocates nothing of size F for the sparse layout. Raises ``StoreError`` on a width mismatch
    or inconsistent lists.
    """
    if feature_format_of(table.column_names) == "dense":
        column = table.column(DENSE_COLUMN)
        if column.type.list_size != width:
            raise StoreError(f"dense features have width {column.type.list_size}, the manifest says {width}")
        return features_matrix(column)
    import scipy.sparse as sp

    idx, val = (table.column(c) for c in SPARSE_COLUMNS)
    lengths = _list_lengths(idx)
    if not np.array_equal(lengths, _list_lengths(val)):
        raise StoreError(f"sparse features: {SPARSE_COLUMNS[0]} and {SPARSE_COLUMNS[1]} differ in row lengths")
    indptr = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.array(_flat_values(idx), dtype=np.int32)
    data = np.array(_flat_values(val), dtype=np.float32)
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= width):
        raise StoreError(f"sparse features: a column id lies outside [0, {width})")
    return sp.csr_matrix((data, indices, indptr), shape=(len(lengths), width))


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    if column.null_count:
        raise StoreError("sparse features: a feature list is null")
    return pc.list_value_length(column).to_numpy().astype(np.int64)


def _flat_values(column: pa.ChunkedArray) -> np.ndarray:
    """Every list's values, concatenated (respects slices and chunks)."""
    flat = pc.list_flatten(column)
    return flat.to_numpy() if len(flat) else np.empty(0)


def features_nonnegative(table: pa.Table) -> bool:
    """True when no feature value of ``table`` (either layout) is negative (e.g. counts, TF-IDF)."""
    column = table.column(DENSE_COLUMN if feature_format_of(table.column_names) == "dense" else SPARSE_COLUMNS[1])
    smallest = pc.min(pc.list_flatten(column)).as_py()
    return smallest is None or smallest >= 0


def take_feature_rows(table: pa.Table, rows: np.ndarray) -> dict[str, pa.ChunkedArray | pa.Array]:
    """The feature columns (either layout) of ``rows`` (positions, in the given order), as columns
    for another table; sparse rows stay sparse."""
    names = feature_columns(feature_format_of(table.column_names))
    index = pa.array(rows, pa.int64())
    return {name: table.column(name).take(index) for name in names}


# --------------------------------------------------------------------------- other tables and files


def edges_table(src: np.ndarray, dst: np.ndarray) -> pa.Table:
    return pa.table({"src": pa.array(src, pa.int64()), "dst": pa.array(dst, pa.int64())})


def repair_hint(path: Path) -> str:
    """What to do about a corrupt file of the store at ``path``: datasets are not rebuilt by a later
    command, everything else (partitions, layers, runs) is."""
    parts = Path(path).parts
    if any(a == "datasets" and b.startswith("name=") for a, b in zip(parts, parts[1:])):
        return "run `retexo store verify --repair` to remove it, then ingest the data again"
    return "run `retexo store verify --repair` to remove it so that it is rebuilt"


def parquet_problem(exc: BaseException) -> str:
    """A short, one-line reason from a pyarrow error (without pyarrow's ``'<Buffer>'`` preamble)."""
    text = " ".join(str(exc).split())
    if ": " in text and text.startswith("Could not open Parquet input source"):
        text = text.split(": ", 1)[1]
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= 160 else text[:157] + "..."


@contextmanager
def parquet_errors(path: Path) -> Iterator[None]:
    """Turn pyarrow's errors while reading ``path`` into one ``StoreError`` line naming the file."""
    try:
        yield
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; {repair_hint(path)}") from None
    except PermissionError:
        raise StoreError(f"{path}: not readable (permission denied); check the store's file permissions") from None
    except (pa.ArrowException, OSError) as exc:
        raise StoreError(f"{path}: corrupt Parquet file ({parquet_problem(exc)}); {repair_hint(path)}") from None


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Read a Parquet file through a Python file object, so that ``open`` audit hooks see it.

    A missing or unreadable file (truncated, not Parquet) is a ``StoreError`` naming ``path``.
    """
    with parquet_errors(path), open(path, "rb") as handle:
        return pq.ParquetFile(handle).read(columns=columns)  # not read_table: it imports pyarrow.dataset (0.5 s)


def decoded_feature_bytes(path: Path, feature_format: FeatureFormat, num_nodes: int, num_features: int) -> int:
    """The in-memory size of the feature matrix stored at ``path``, read from the Parquet footer only:
    N x F x 4 bytes (float32) dense, non-zeros x 8 bytes (int32 column id, float32 value) sparse."""
    if feature_format == "dense":
        return num_nodes * num_features * 4
    with parquet_errors(path), open(path, "rb") as handle:
        metadata = pq.ParquetFile(handle).metadata
        column = next(i for i in range(metadata.num_columns)
                      if metadata.schema.column(i).path.startswith(SPARSE_COLUMNS[0] + "."))
        nonzeros = sum(metadata.row_group(g).column(column).num_values for g in range(metadata.num_row_groups))
    return nonzeros * 8
