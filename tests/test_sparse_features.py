"""Sparse features end to end: detection at ingest, the sparse Parquet layout of datasets and
partitions, and loading them sparse for the workers.

Layouts (``graphstore.parquet_io``): dense ``x fixed_size_list<float32>[F]``; sparse
``x_idx list<int32>`` + ``x_val list<float32>`` with F in the manifest's ``num_features``.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp

from conftest import CORA_DIR, PartitionedGraph, TableFiles, dataset_features, run_cli, write_tables
from graphstore.errors import InputError, StoreError
from graphstore.ingest.api import ingest_planetoid, ingest_tables
from graphstore.ingest.features import SPARSE_DENSITY, as_stored, density, stored_format
from graphstore.ingest.planetoid import safe_load
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.tables import TableOptions
from graphstore.layout import Store
from graphstore.lookup import DatasetRef, find_dataset
from graphstore.manifests import DatasetManifest, PartitionManifest, read_manifest
from graphstore.parquet_io import SPARSE_COLUMNS, features_of, sparse_feature_columns, sparse_features_table
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from retexo_core.data import load_part, load_whole_graph
from retexo_core.sparse import SparseMatrix


def stored_csr(ref: DatasetRef) -> sp.csr_matrix:
    x = features_of(pq.read_table(ref.path / "features.parquet"), ref.num_features)
    assert isinstance(x, sp.csr_matrix)
    return x


def assert_same_csr(a: sp.csr_matrix, b: sp.csr_matrix) -> None:
    """Identical CSR structure and values (not just equal as dense matrices)."""
    assert a.shape == b.shape
    assert np.array_equal(a.indptr, b.indptr)
    assert np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.data, b.data)


def planetoid_reference_features(folder: Path, prefix: str = "cora") -> np.ndarray:
    """The reference GCN loader's dense feature matrix, computed from the pickles independently."""
    allx = safe_load(folder / f"ind.{prefix}.allx").toarray()
    tx = safe_load(folder / f"ind.{prefix}.tx").toarray()
    test_index = np.array([int(v) for v in (folder / f"ind.{prefix}.test.index").read_text().split()])
    features = np.vstack([allx, tx])
    features[test_index] = features[np.sort(test_index)]
    return features.astype(np.float32)


# --------------------------------------------------------------------------- Cora


def test_cora_is_stored_sparse_and_round_trips_exactly(cora: PartitionedGraph):
    ref = cora.dataset
    manifest = read_manifest(ref.path, DatasetManifest)
    assert (manifest.feature_format, manifest.num_features, manifest.format) == ("sparse", 1433, 2)
    schema = pq.read_schema(ref.path / "features.parquet")
    assert schema.names == ["node_id", *SPARSE_COLUMNS]
    for column, value_type in (("x_idx", pa.int32()), ("x_val", pa.float32())):
        assert pa.types.is_list(schema.field(column).type) and schema.field(column).type.value_type == value_type
    x = stored_csr(ref)
    assert x.shape == (2708, 1433) and x.nnz == 49216  # Cora's 49,216 words
    assert np.all(np.diff(x.indices)[np.diff(np.repeat(np.arange(2708), np.diff(x.indptr))) == 0] > 0)  # sorted ids
    assert np.array_equal(x.toarray(), planetoid_reference_features(CORA_DIR))


def test_cora_declared_dense_holds_the_same_matrix(cora: PartitionedGraph, tmp_path: Path):
    dense = ingest_planetoid(Store.open(tmp_path), CORA_DIR, "cora", feature_format="dense")
    assert dense.fp != cora.dataset.fp  # the option is part of the fingerprint
    assert read_manifest(dense.path, DatasetManifest).feature_format == "dense"
    assert pq.read_schema(dense.path / "features.parquet").names == ["node_id", "x"]
    assert np.array_equal(dataset_features(dense), stored_csr(cora.dataset).toarray())


@pytest.mark.parametrize("method", ["random", "metis", "supernode"])
def test_cora_parts_hold_exactly_their_owned_rows_sparse(cora: PartitionedGraph, method: str):
    ref = cora.partitions[method]
    assert read_manifest(ref.path, PartitionManifest).feature_format == "sparse"
    assert read_manifest(ref.path, PartitionManifest).format == 2
    whole = stored_csr(cora.dataset)
    node_id = pq.read_table(cora.dataset.path / "nodes.parquet", columns=["node_id"]).column("node_id").to_numpy()
    seen = 0
    for i in range(ref.parts):
        table = pq.read_table(ref.path / f"part={i}/nodes.parquet")
        assert "x" not in table.column_names and set(SPARSE_COLUMNS) <= set(table.column_names)
        part_x = features_of(table, cora.dataset.num_features)
        rows = np.searchsorted(node_id, table.column("node_id").to_numpy())
        assert_same_csr(part_x, whole[rows])
        seen += part_x.nnz
    assert seen == whole.nnz


# --------------------------------------------------------------------------- loading for workers


def test_load_part_returns_the_dataset_rows_as_a_sparse_matrix(cora: PartitionedGraph):
    ref = cora.partitions["metis"]
    whole = stored_csr(cora.dataset)
    node_id = pq.read_table(cora.dataset.path / "nodes.parquet", columns=["node_id"]).column("node_id").to_numpy()
    for i in range(ref.parts):
        data = load_part(ref.path, i)
        assert isinstance(data.x, SparseMatrix)
        assert data.x.shape == (data.num_owned, 1433)
        assert data.x.val.dtype.is_floating_point and str(data.x.val.dtype) == "torch.float32"
        assert_same_csr(data.x.to_scipy(), whole[np.searchsorted(node_id, data.node_id)])


def test_load_whole_graph_is_sparse_for_a_sparse_dataset(cora: PartitionedGraph):
    data = load_whole_graph(cora.dataset.path)
    assert isinstance(data.x, SparseMatrix)
    assert_same_csr(data.x.to_scipy(), stored_csr(cora.dataset))


def test_load_part_of_a_dense_dataset_stays_a_dense_tensor(synthetic_graph: PartitionedGraph):
    import torch

    data = load_part(synthetic_graph.partitions["random"].path, 0)
    assert isinstance(data.x, torch.Tensor) and data.x.dtype == torch.float32
    assert data.x.shape == (data.num_owned, synthetic_graph.dataset.num_features)


_RECORDERS: list[list[str]] = []  # the lists being filled by open ``opened_files`` blocks


def _record_open(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and _RECORDERS and isinstance(args[0], (str, Path)):
        _RECORDERS[-1].append(str(args[0]))


sys.addaudithook(_record_open)  # hooks cannot be removed: this one records only inside ``opened_files``


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """Paths opened through Python's ``open`` (audit event ``open``) inside the block."""
    opened: list[str] = []
    _RECORDERS.append(opened)
    try:
        yield opened
    finally:
        _RECORDERS.remove(opened)


def test_a_worker_reads_only_its_part_and_the_partition_manifest(cora: PartitionedGraph):
    ref = cora.partitions["random"]
    load_part(ref.path, 1)  # warm up imports, so only data files are opened below
    with opened_files() as opened:
        load_part(ref.path, 1)
    store_files = [p for p in opened if p.startswith(str(cora.store.root))]
    # the partition manifest was parsed by the warm-up call: workers keep it per process
    assert {Path(p).relative_to(ref.path).as_posix() for p in store_files} == {
        "part=1/nodes.parquet", "part=1/edges.parquet", "part=1/halo.parquet",
    }


# --------------------------------------------------------------------------- tables: detection and declaration


def write_mostly_zero_features(files: TableFiles, width: int = 40, fraction: float = 0.05, seed: int = 0) -> np.ndarray:
    """Replace the tables' features with a dense CSV (every cell written) that is mostly zeros."""
    ids = [int(line.split(",")[0]) for line in files.nodes.read_text().splitlines()[1:]]
    rng = np.random.default_rng(seed)
    x = np.where(rng.random((len(ids), width)) < fraction, rng.random((len(ids), width)).round(3) + 0.5, 0.0)
    header = "node_id," + ",".join(f"f{j}" for j in range(width))
    files.features.write_text(header + "\n" + "".join(f"{n}," + ",".join(map(str, row)) + "\n" for n, row in zip(ids, x)))
    return x.astype(np.float32)


def ingest_with(store: Store, files: TableFiles, feature_format: str, name: str = "t") -> DatasetRef:
    options = TableOptions(undirected=True, feature_format=feature_format)
    return ingest_tables(store, name, files.edges, files.nodes, files.features, options, SplitFractions())


def node_order(ref: DatasetRef) -> np.ndarray:
    return pq.read_table(ref.path / "nodes.parquet", columns=["node_id"]).column("node_id").to_numpy()


def test_mostly_zero_csv_is_stored_sparse_under_auto_and_dense_when_declared(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    expected = write_mostly_zero_features(files)
    assert density(expected) <= SPARSE_DENSITY
    store = Store.open(tmp_path / "store")
    refs = {fmt: ingest_with(store, files, fmt) for fmt in ("auto", "dense", "sparse")}
    formats = {fmt: read_manifest(ref.path, DatasetManifest).feature_format for fmt, ref in refs.items()}
    assert formats == {"auto": "sparse", "dense": "dense", "sparse": "sparse"}
    assert len({ref.fp for ref in refs.values()}) == 3  # feature_format is an ingest option: part of the fp
    for ref in refs.values():
        assert ref.num_features == 40
        # the tables' node ids are 100, 103, ...: rows in the store follow node id order, as in the CSV
        assert np.array_equal(dataset_features(ref), expected)
    assert pq.read_schema(refs["dense"].path / "features.parquet").names == ["node_id", "x"]
    assert pq.read_schema(refs["auto"].path / "features.parquet").names == ["node_id", "x_idx", "x_val"]


def test_dense_table_stays_dense_under_auto_and_becomes_sparse_when_declared(tmp_path: Path):
    files = write_tables(tmp_path / "input")  # Gaussian features: density 1
    store = Store.open(tmp_path / "store")
    auto, sparse = ingest_with(store, files, "auto"), ingest_with(store, files, "sparse")
    assert read_manifest(auto.path, DatasetManifest).feature_format == "dense"
    assert read_manifest(sparse.path, DatasetManifest).feature_format == "sparse"
    assert np.array_equal(dataset_features(sparse), dataset_features(auto))
    assert stored_csr(sparse).nnz == int(np.count_nonzero(dataset_features(auto)))


def test_feature_format_option_of_the_cli(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    store = tmp_path / "store"
    args = ["ingest", "tables", "--name", "cli", "--edges", files.edges, "--nodes", files.nodes,
            "--features", files.features, "--undirected"]
    result = run_cli(*args, "--feature-format", "sparse", store=store)
    assert result.returncode == 0, result.stderr
    ref = find_dataset(Store.open(store), "cli")
    assert read_manifest(ref.path, DatasetManifest).feature_format == "sparse"
    bad = run_cli(*args, "--feature-format", "csr", store=store)
    assert bad.returncode == 2 and "--feature-format" in bad.stderr


def test_density_threshold_is_inclusive():
    at = np.zeros((10, 10), np.float32)
    at.flat[:10] = 1.0  # density exactly 0.1
    above = at.copy()
    above.flat[10] = 1.0
    assert stored_format(at, "auto") == "sparse" and stored_format(above, "auto") == "dense"
    assert stored_format(sp.csr_matrix(np.ones((4, 4), np.float32)), "auto") == "sparse"  # arrived sparse
    with pytest.raises(InputError, match="--feature-format"):
        stored_format(at, "csr")  # type: ignore[arg-type]


def test_as_stored_drops_explicit_zeros_and_never_changes_its_input():
    source = sp.csr_matrix((np.array([0.0, 2.0], np.float32), np.array([1, 3]), np.array([0, 2, 2])), shape=(2, 5))
    stored = as_stored(source, "sparse")
    assert stored.nnz == 1 and source.nnz == 2
    assert np.array_equal(as_stored(source, "dense"), source.toarray())


# --------------------------------------------------------------------------- JSON active ids


def write_json_tables(folder: Path, features: str) -> TableFiles:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "edges.csv").write_text("src,dst\n1,2\n2,3\n")
    (folder / "nodes.csv").write_text("node_id,label\n1,0\n2,1\n3,0\n")
    (folder / "features.json").write_text(features)
    return TableFiles(folder / "edges.csv", folder / "nodes.csv", folder / "features.json")


def test_json_features_stay_sparse_even_when_not_very_sparse(tmp_path: Path):
    files = write_json_tables(tmp_path / "in", '{"3": [0, 2, 2], "1": [1], "2": []}')  # density 4/9
    ref = ingest_with(Store.open(tmp_path / "store"), files, "auto")
    assert read_manifest(ref.path, DatasetManifest).feature_format == "sparse"
    x = stored_csr(ref)
    assert ref.num_features == 3
    assert np.array_equal(x.toarray(), [[0, 1, 0], [0, 0, 0], [1, 0, 1]])  # rows by node id; repeats count once


def test_json_with_a_huge_feature_id_never_builds_a_dense_matrix(tmp_path: Path):
    """3 nodes naming feature 50,000,000: dense would be 3 x 50e6 x 4 bytes = 600 MB."""
    files = write_json_tables(tmp_path / "in", '{"1": [7, 50000000], "2": [3], "3": [50000000]}')
    store = Store.open(tmp_path / "store")
    dense_bytes = 3 * 50_000_001 * 4
    tracemalloc.start()
    started = time.perf_counter()
    try:
        ref = ingest_with(store, files, "auto")
        partition = build_partition(store, ref, PartitionOptions(method="random", parts=3, seed=0))
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - started
    assert peak < dense_bytes / 100, f"peak traced allocation {peak} bytes"
    assert seconds < 30
    assert (ref.num_features, read_manifest(ref.path, DatasetManifest).feature_format) == (50_000_001, "sparse")
    x = stored_csr(ref)
    assert x.nnz == 4 and x.indices.tolist() == [7, 50_000_000, 3, 50_000_000]
    parts = [features_of(pq.read_table(partition.path / f"part={i}/nodes.parquet"), ref.num_features)
             for i in range(3)]
    assert sorted(p.nnz for p in parts) == [1, 1, 2]


def test_json_feature_id_beyond_int32_is_refused(tmp_path: Path):
    files = write_json_tables(tmp_path / "in", '{"1": [1], "2": [2147483647], "3": []}')
    with pytest.raises(InputError, match=r"features.json, column 'x', row 2: feature id 2147483647 is larger"):
        ingest_with(Store.open(tmp_path / "store"), files, "auto")


# --------------------------------------------------------------------------- the Parquet layout


def test_sparse_table_round_trip_and_width_checks():
    x = sp.random(50, 30, density=0.1, format="csr", dtype=np.float32, random_state=1)
    table = sparse_features_table(np.arange(50), x)
    back = features_of(table, 30)
    assert_same_csr(back, x)
    assert_same_csr(features_of(table.slice(10, 20), 30), x[10:30])  # slices keep their offsets right
    with pytest.raises(StoreError, match="outside"):
        features_of(table, 5)
    empty = features_of(sparse_features_table(np.arange(0), sp.csr_matrix((0, 30), dtype=np.float32)), 30)
    assert empty.shape == (0, 30) and empty.nnz == 0


def test_sparse_columns_are_chunked_below_the_offset_limit():
    """Arrow list offsets are int32: big matrices are cut into row chunks (here of <= 12 entries, the width)."""
    x = sp.random(40, 12, density=0.2, format="csr", dtype=np.float32, random_state=2)
    columns = sparse_feature_columns(x, max_chunk_entries=12)
    assert columns["x_idx"].num_chunks > 1
    assert all(len(pc.list_flatten(chunk)) <= 12 for chunk in columns["x_idx"].chunks)
    assert_same_csr(features_of(pa.table(columns), 12), x)
    with pytest.raises(ValueError, match="more than 1 stored entries"):
        sparse_feature_columns(sp.csr_matrix(np.ones((2, 2), np.float32)), max_chunk_entries=1)
