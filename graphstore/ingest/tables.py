"""A user's own graph from CSV/Parquet tables (and an optional sparse JSON feature file).

- edges: CSV or Parquet with a source and a target column (default ``src``, ``dst``).
- nodes: ``node_id``, ``label`` (-1 or empty = unknown), optional ``split``
  (train|val|test|none); any other columns are kept (e.g. a site column for ``--method column``).
- features (optional): CSV/Parquet with ``node_id`` and either columns ``f0..f{F-1}`` or one
  list column; or a ``.json`` object mapping node id to a list of active feature ids (sparse
  binary, read straight into a CSR matrix: nothing of size N x F is allocated). Without a
  features file every node gets the single constant feature 1.0.

How the features are stored (dense or sparse) is ``TableOptions.feature_format``; see
``graphstore.ingest.features`` for the ``auto`` rule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import scipy.sparse
from pydantic import BaseModel, Field

from graphstore.errors import InputError
from graphstore.ingest.features import REQUESTED_FORMAT_HELP, RequestedFormat
from graphstore.ingest.graph import SourceGraph
from graphstore.ingest.validate import check_unique_ids, first_true

if TYPE_CHECKING:
    import scipy.sparse

    from graphstore.parquet_io import FeatureMatrix

TABLE_SUFFIXES = (".csv", ".csv.gz", ".parquet", ".pq")
FEATURE_COLUMN = re.compile(r"^f(\d+)$")


class TableOptions(BaseModel):
    """How to read the user's tables (part of the dataset fingerprint)."""

    src_column: str = Field("src", description="Edge source column.")
    dst_column: str = Field("dst", description="Edge target column.")
    undirected: bool = Field(False, description="Add the reverse of every edge.")
    num_classes: int | None = Field(None, description="Number of classes (default: largest label + 1).")
    remote_sources: bool = Field(False, description="A site's own tables: edge sources may be node ids other sites "
                                 "hold (not in the nodes table); every edge must end at one of this site's nodes.")
    feature_format: RequestedFormat = Field("auto", description=REQUESTED_FORMAT_HELP)
    missing_features: Literal["constant", "identity", "zero"] = Field(
        "constant", description="Nodes without features. Without a features file: constant (every node the one "
        "feature 1.0) or identity (node i the one-hot feature i, stored sparse: the first layer learns an embedding "
        "per node; width = the number of nodes). With one: every node needs a row, except with zero (a node without "
        "a row gets zeros, e.g. users with features and items without).")


def find_table_files(folder: Path) -> tuple[Path, Path, Path | None]:
    """(edges, nodes, features or None) of an export folder: files named ``edges``, ``nodes`` and
    ``features`` with a table suffix (features may also be ``.json``); exactly one of each."""
    if not folder.is_dir():
        raise InputError(str(folder), "tables folder does not exist")
    found: dict[str, Path | None] = {}
    for role, suffixes in (("edges", TABLE_SUFFIXES), ("nodes", TABLE_SUFFIXES), ("features", TABLE_SUFFIXES + (".json",))):
        matches = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower() in {role + s for s in suffixes})
        if len(matches) > 1:
            raise InputError(str(folder), f"several {role} files ({', '.join(p.name for p in matches)}): keep one")
        if not matches and role != "features":
            raise InputError(str(folder), f"no {role} file (expected {role}.csv, {role}.parquet, ...)")
        found[role] = matches[0] if matches else None
    return found["edges"], found["nodes"], found["features"]  # type: ignore[return-value]


def estimated_rows(path: Path) -> int:
    """Rows of a table file without reading it: Parquet's footer, or a CSV's size divided by the
    mean line length of its first MB. 0 for a file that is missing (loading reports it)."""
    if not path.is_file():
        return 0
    if path.name.lower().endswith((".parquet", ".pq")):
        try:
            return int(pq.ParquetFile(path).metadata.num_rows)
        except (pa.ArrowInvalid, OSError):
            return 0
    with open(path, "rb") as handle:
        sample = handle.read(2**20)
    lines = max(sample.count(b"\n"), 1)
    return int(path.stat().st_size * lines / max(len(sample), 1))


def estimated_feature_bytes(path: Path) -> int:
    """Memory the features file takes once decoded: Parquet's uncompressed size, a CSV's numbers
    (about 8 bytes each once parsed, twice: Arrow and float32), or a JSON file's Python objects
    (about 12 bytes per byte of text)."""
    if not path.is_file():
        return 0
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        try:
            meta = pq.ParquetFile(path).metadata
            return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) * 2
        except (pa.ArrowInvalid, OSError):
            return 0
    return path.stat().st_size * (12 if name.endswith(".json") else 4)


def read_any_table(path: Path) -> pa.Table:
    """Read a CSV or Parquet file; wrong type, unreadable or empty files raise ``InputError``."""
    if not path.is_file():
        raise InputError(str(path), "file does not exist")
    name = path.name.lower()
    if not name.endswith(TABLE_SUFFIXES):
        raise InputError(str(path), f"unsupported file type: expected one of {', '.join(TABLE_SUFFIXES)}")
    if path.stat().st_size == 0:
        raise InputError(str(path), "file is empty")
    try:
        if name.endswith((".parquet", ".pq")):
            table = pq.read_table(path)
        else:
            table = pacsv.read_csv(path)
    except (pa.ArrowInvalid, OSError) as exc:
        kind = "Parquet" if name.endswith((".parquet", ".pq")) else "CSV"
        raise InputError(str(path), f"cannot be read as {kind}: {exc}") from exc
    if table.num_rows == 0:
        raise InputError(str(path), "file has a header but no rows")
    return table


def require_column(table: pa.Table, column: str, path: Path) -> pa.ChunkedArray:
    if column not in table.column_names:
        raise InputError(str(path), f"missing column (found: {', '.join(table.column_names)})", column)
    return table.column(column)


INT64_MAX = np.iinfo(np.int64).max
INT64_RANGE = "-2^63 .. 2^63-1"


def integer_column(table: pa.Table, column: str, path: Path, null_value: int | None = None) -> np.ndarray:
    """A column as int64; nulls are an error unless ``null_value`` replaces them."""
    values = require_column(table, column, path)
    if values.null_count and null_value is None:
        row = first_true(values.is_null().to_numpy(zero_copy_only=False))
        raise InputError(str(path), "missing value", column, row + 1)
    if pa.types.is_null(values.type):  # every cell empty (CSV): all replaced by null_value
        return np.full(len(values), null_value, np.int64)
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        row = first_unparsable(values, int)
        raise InputError(str(path), f"expected an integer, found {values.type} '{values[row].as_py()}'", column, row + 1)
    if values.null_count:
        values = pc.fill_null(values, null_value)
    if pa.types.is_integer(values.type):
        numbers = values.to_numpy()
        if numbers.dtype == np.uint64 and (numbers > INT64_MAX).any():  # CSV ids in 2^63 .. 2^64-1
            row = first_true(numbers > INT64_MAX)
            raise InputError(str(path), f"{numbers[row]} is outside the int64 range ({INT64_RANGE})", column, row + 1)
        return numbers.astype(np.int64)
    floats = values.to_numpy()
    bad = ~np.isfinite(floats) | (floats != np.round(floats))
    if bad.any():
        row = first_true(bad)
        raise InputError(str(path), f"expected an integer, found {floats[row]}", column, row + 1)
    # a CSV column of integers beyond 2^64 is read as float; so is one that needs more than 53 bits
    outside = np.abs(floats) >= 2.0 ** 63
    if outside.any():
        row = first_true(outside)
        raise InputError(str(path), f"{floats[row]:.0f} is outside the int64 range ({INT64_RANGE})", column, row + 1)
    return floats.astype(np.int64)


def first_unparsable(values: pa.ChunkedArray, parse: type) -> int:
    """Row (0-based) of the first non-null value that ``parse`` (``int`` or ``float``) rejects; 0 if none.

    Used only on error paths, for columns Arrow did not read as numbers (e.g. one word among
    numbers in a CSV column makes the whole column text).
    """
    for row, value in enumerate(values.to_pylist()):
        if value is None:
            continue
        try:
            parse(value)
        except (TypeError, ValueError):
            return row
    return 0


def read_features(path: Path, node_id: np.ndarray, zero_missing: bool = False) -> "FeatureMatrix":
    """(N, F) float32 features aligned with ``node_id``; every node needs exactly one row (with
    ``zero_missing``, at most one: a node without a row gets zeros).

    An ndarray for CSV/Parquet tables, a ``scipy.sparse.csr_matrix`` for a JSON file.
    """
    if path.name.lower().endswith(".json"):
        ids, x = _sparse_json_features(path)
    else:
        table = read_any_table(path)
        ids = integer_column(table, "node_id", path)
        check_unique_ids(ids, str(path))
        x = _dense_features(table, path)
    order = np.argsort(ids)
    ids, x = ids[order], x[order]
    pos = np.searchsorted(ids, node_id).clip(0, len(ids) - 1)
    missing = ids[pos] != node_id
    if missing.any() and not zero_missing:
        raise InputError(str(path), f"no feature row for node {node_id[first_true(missing)]} (--missing-features zero "
                                    "gives such nodes zeros)", "node_id")
    x = x[pos]
    if missing.any():
        present = (~missing).astype(np.float32)
        x = scipy.sparse.diags(present).tocsr() @ x if scipy.sparse.issparse(x) else x * present[:, None]
    return x


def _dense_features(table: pa.Table, path: Path) -> np.ndarray:
    numbered = sorted(
        (int(m.group(1)), c) for c in table.column_names if (m := FEATURE_COLUMN.match(c))
    )
    if numbered:
        expected = list(range(len(numbered)))
        if [i for i, _ in numbered] != expected:
            raise InputError(str(path), f"feature columns must be f0..f{len(numbered) - 1} without gaps", numbered[-1][1])
        columns = []
        for _, name in numbered:
            column = table.column(name)
            if column.null_count:
                row = first_true(column.is_null().to_numpy(zero_copy_only=False))
                raise InputError(str(path), "missing or NaN feature value (an empty, NA or NaN cell)", name, row + 1)
            if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
                row = first_unparsable(column, float)
                raise InputError(str(path), f"expected a number, found {column.type} '{column[row].as_py()}'",
                                 name, row + 1)
            columns.append(column.to_numpy().astype(np.float32))
        x = np.stack(columns, axis=1)
        _check_finite(x, path, lambda col: numbered[col][1])
        return x
    lists = [c for c in table.column_names if pa.types.is_list(table.schema.field(c).type)
             or pa.types.is_large_list(table.schema.field(c).type)
             or pa.types.is_fixed_size_list(table.schema.field(c).type)]
    if len(lists) != 1:
        raise InputError(str(path), "expected feature columns f0..fN or exactly one list column", "x")
    name = lists[0]
    column = table.column(name).combine_chunks()
    if column.null_count:
        row = first_true(column.is_null().to_numpy(zero_copy_only=False))
        raise InputError(str(path), "missing feature list", name, row + 1)
    lengths = pc.list_value_length(column).to_numpy()
    ragged = lengths != lengths[0]
    if ragged.any():
        row = first_true(ragged)
        raise InputError(str(path), f"ragged feature widths: row 1 has {lengths[0]}, this row {lengths[row]}", name, row + 1)
    x = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).reshape(len(column), int(lengths[0]))
    _check_finite(x, path, lambda _col: name)
    return x


def _check_finite(x: np.ndarray, path: Path, column_name: object) -> None:
    finite = np.isfinite(x)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        raise InputError(str(path), f"feature value {x[row, col]} is not finite", column_name(col), int(row) + 1)


def _sparse_json_features(path: Path) -> tuple[np.ndarray, "scipy.sparse.csr_matrix"]:
    """``{"<node id>": [active feature ids], ...}`` -> (ids, (N, F) binary float32 CSR matrix).

    F = largest id + 1; a repeated id in a list counts once. Memory is O(N + entries): the
    matrix is built from its row pointer and column ids directly, never densely.
    """
    import scipy.sparse as sp  # imported here: it adds ~0.15 s to every CLI start

    if not path.is_file():
        raise InputError(str(path), "file does not exist")
    if path.stat().st_size == 0:
        raise InputError(str(path), "file is empty")
    try:
        payload = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(str(path), f"cannot be read as JSON: {exc}") from exc
    if not isinstance(payload, dict) or not payload:
        raise InputError(str(path), "expected a non-empty JSON object mapping node id to a list of feature ids")
    largest_id = np.iinfo(np.int32).max - 1  # column ids are stored as int32, the width as id + 1
    ids, actives = [], []
    for row, (key, value) in enumerate(payload.items(), start=1):
        try:
            ids.append(int(key))
        except ValueError:
            raise InputError(str(path), f"key '{key}' is not an integer node id", "node_id", row) from None
        if not -INT64_MAX - 1 <= ids[-1] <= INT64_MAX:
            raise InputError(str(path), f"{key} is outside the int64 range ({INT64_RANGE})", "node_id", row)
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise InputError(str(path), f"expected a list of non-negative integer feature ids, found {value!r}", "x", row)
        if value and max(value) > largest_id:
            raise InputError(str(path), f"feature id {max(value)} is larger than {largest_id}", "x", row)
        actives.append(sorted(set(value)))
    lengths = np.fromiter((len(a) for a in actives), dtype=np.int64, count=len(actives))
    indptr = np.zeros(len(actives) + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.fromiter((v for a in actives for v in a), dtype=np.int32, count=int(indptr[-1]))
    width = int(indices.max()) + 1 if len(indices) else 0
    if width == 0:
        raise InputError(str(path), "no node has an active feature")
    x = sp.csr_matrix((np.ones(len(indices), np.float32), indices, indptr), shape=(len(actives), width))
    id_array = np.array(ids, dtype=np.int64)
    check_unique_ids(id_array, str(path))
    return id_array, x


def load_tables(edges_path: Path, nodes_path: Path, features_path: Path | None, options: TableOptions) -> SourceGraph:
    """Read, type-check and assemble the user's tables (value checks follow in ``validate_graph``)."""
    edges = read_any_table(edges_path)
    src = integer_column(edges, options.src_column, edges_path)
    dst = integer_column(edges, options.dst_column, edges_path)

    nodes = read_any_table(nodes_path)
    node_id = integer_column(nodes, "node_id", nodes_path)
    check_unique_ids(node_id, str(nodes_path))
    label = integer_column(nodes, "label", nodes_path, null_value=-1)
    split = None
    if "split" in nodes.column_names:
        split_column = nodes.column("split")
        if not (pa.types.is_string(split_column.type) or pa.types.is_large_string(split_column.type)):
            raise InputError(str(nodes_path), f"expected text (train|val|test|none), found {split_column.type}", "split", 1)
        split = np.asarray(pc.fill_null(split_column, "none").to_numpy(zero_copy_only=False), dtype=object)
    extra = {
        c: nodes.column(c).to_numpy(zero_copy_only=False)
        for c in nodes.column_names
        if c not in ("node_id", "label", "split")
    }
    if features_path is None and options.missing_features == "zero":
        raise InputError("--missing-features", "zero fills the rows a features file lacks: give --features, or use "
                                               "constant or identity")
    if features_path is None and options.missing_features == "identity":
        x = scipy.sparse.identity(len(node_id), dtype=np.float32, format="csr")
    elif features_path is None:
        x = np.ones((len(node_id), 1), np.float32)
    else:
        x = read_features(features_path, node_id, zero_missing=options.missing_features == "zero")
    num_classes = options.num_classes if options.num_classes is not None else int(max(label.max(), -1) + 1)
    files = {"edges": str(edges_path), "nodes": str(nodes_path), "features": str(features_path or nodes_path)}
    return SourceGraph(
        node_id=node_id, label=label, split=split, x=x, src=src, dst=dst,
        num_classes=num_classes, extra=extra, files=files, undirected=options.undirected,
        edge_columns=(options.src_column, options.dst_column), remote_sources=options.remote_sources,
    )
