"""Bad inputs are refused by the real CLI: non-zero exit, a message naming file, column and first
offending row (1-based data rows), and the store left exactly as it was (files, sizes, mtimes).

Every test starts from a store that already holds a dataset, so "unchanged" is not trivially true.
Each kind of defect has a test through the real CLI in a subprocess (exit code included); further
variants of a defect run the same command line in-process (typer's runner, ``via="app"``) to keep
the suite fast, with the same message and store checks.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli.app import app
from graphstore.errors import RetexoError
from conftest import CORA_DIR, TableFiles, dataset_features, flat, run_cli, snapshot, write_planetoid, write_tables
from graphstore.layout import Store
from graphstore.lookup import find_dataset


@pytest.fixture
def files(tmp_path: Path) -> TableFiles:
    """Valid CSV tables (60 nodes, ids 100, 103, ..., 277) that each test breaks in one place."""
    return write_tables(tmp_path / "input")


def ingest_args(files: TableFiles, edges: Path | None = None, nodes: Path | None = None,
                features: Path | None = None, *extra: str) -> list[str]:
    return [
        "ingest", "tables", "--name", "broken",
        "--edges", str(edges or files.edges),
        "--nodes", str(nodes or files.nodes),
        "--features", str(features or files.features),
        *extra,
    ]


def run_in_process(args: list[str], store: Path) -> str:
    """The same command line through the typer app in this process; returns the error message."""
    result = CliRunner().invoke(app, [*args, "--store", str(store)])
    assert isinstance(result.exception, RetexoError), (result.exit_code, result.output, result.exception)
    return "error: " + flat(str(result.exception))


def expect_refused(store: Path, args: list[str], file: Path, column: str | None, row: int | None,
                   *words: str, via: str = "cli") -> str:
    """Run the command and check exit code, message and that ``store`` did not change at all."""
    before = snapshot(store)
    if via == "cli":
        result = run_cli(*args, store=store)
        message = flat(result.stderr)
        assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
    else:
        message = run_in_process(args, store)
    assert message.startswith("error:"), message
    assert str(file) in message, message
    if column is not None:
        assert f"column '{column}'" in message, message
    if row is not None:
        assert f"row {row}:" in message, message
    for word in words:
        assert word in message, message
    assert snapshot(store) == before, "the store changed"
    return message


def rewrite_line(path: Path, row: int, new: str) -> None:
    """Replace data row ``row`` (1-based, after the header) of a CSV file."""
    lines = path.read_text().splitlines()
    lines[row] = new
    path.write_text("\n".join(lines) + "\n")


def csv_line(path: Path, row: int) -> list[str]:
    return path.read_text().splitlines()[row].split(",")


def test_the_valid_files_are_accepted(store_with_dataset: Path, files: TableFiles):
    """Control: the unbroken inputs ingest fine (so every refusal below is caused by its defect)."""
    result = run_cli(*ingest_args(files), store=store_with_dataset)
    assert result.returncode == 0, result.stderr
    assert "broken" in result.stdout


# --------------------------------------------------------------------------- nodes table


def test_duplicate_node_ids(store_with_dataset: Path, files: TableFiles):
    # row 3 repeats row 2's id (103); a later duplicate of another id must not be reported first
    second = csv_line(files.nodes, 2)
    rewrite_line(files.nodes, 3, f"{second[0]},0,a")
    rewrite_line(files.nodes, 9, f"{csv_line(files.nodes, 1)[0]},0,a")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "node_id", 3,
                   f"duplicate node id {second[0]}", "also in row 2", via="app")


def test_duplicate_node_ids_first_offending_row_wins(store_with_dataset: Path, files: TableFiles):
    # ids: row 4 repeats row 3 (a large id), row 6 repeats row 1 (a small id): row 4 comes first
    rewrite_line(files.nodes, 4, f"{csv_line(files.nodes, 3)[0]},0,a")
    rewrite_line(files.nodes, 6, f"{csv_line(files.nodes, 1)[0]},0,a")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "node_id", 4, "also in row 3")


def test_non_integer_node_id(store_with_dataset: Path, files: TableFiles):
    rewrite_line(files.nodes, 3, "n3,0,a")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "node_id", 3, "'n3'")


def test_fractional_node_id(store_with_dataset: Path, files: TableFiles):
    rewrite_line(files.nodes, 2, "103.5,0,a")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "node_id", 2, "103.5", via="app")


def test_missing_node_id(store_with_dataset: Path, files: TableFiles):
    rewrite_line(files.nodes, 5, ",0,a")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "node_id", 5, "missing value", via="app")


def test_negative_label_out_of_range(store_with_dataset: Path, files: TableFiles):
    node = csv_line(files.nodes, 4)[0]
    rewrite_line(files.nodes, 4, f"{node},-3,a")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "label", 4, "label -3 is out of range")


def test_label_above_num_classes(store_with_dataset: Path, files: TableFiles):
    node = csv_line(files.nodes, 6)[0]
    rewrite_line(files.nodes, 6, f"{node},5,a")
    expect_refused(store_with_dataset, ingest_args(files) + ["--num-classes", "3"], files.nodes, "label", 6,
                   "label 5 is out of range", "0..2", via="app")


def test_bad_split_value(store_with_dataset: Path, files: TableFiles):
    lines = files.nodes.read_text().splitlines()
    splits = ["train"] * (len(lines) - 1)
    splits[1] = "training"  # row 2
    splits[4] = "validation"
    files.nodes.write_text("\n".join([lines[0] + ",split"] + [f"{l},{s}" for l, s in zip(lines[1:], splits)]) + "\n")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "split", 2, "'training'")


def test_missing_label_column(store_with_dataset: Path, files: TableFiles):
    files.nodes.write_text("\n".join(l.split(",")[0] for l in files.nodes.read_text().splitlines()) + "\n")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, "label", None, "missing column", via="app")


# --------------------------------------------------------------------------- edges table


def test_edge_to_unknown_node(store_with_dataset: Path, files: TableFiles):
    src = csv_line(files.edges, 4)[0]
    rewrite_line(files.edges, 4, f"{src},99999")
    expect_refused(store_with_dataset, ingest_args(files), files.edges, "dst", 4, "node 99999", str(files.nodes),
                   via="app")


def test_edge_to_unknown_node_undirected(store_with_dataset: Path, files: TableFiles):
    """With --undirected the reverse edges must not shift the reported row or column."""
    src = csv_line(files.edges, 7)[0]
    rewrite_line(files.edges, 7, f"{src},77777")
    expect_refused(store_with_dataset, ingest_args(files, None, None, None, "--undirected"), files.edges,
                   "dst", 7, "node 77777")


def test_first_offending_edge_row_across_columns(store_with_dataset: Path, files: TableFiles):
    """An unknown target in row 3 is reported before an unknown source in row 8."""
    rewrite_line(files.edges, 3, f"{csv_line(files.edges, 3)[0]},55555")
    rewrite_line(files.edges, 8, f"66666,{csv_line(files.edges, 8)[1]}")
    expect_refused(store_with_dataset, ingest_args(files), files.edges, "dst", 3, "node 55555", via="app")


def test_edges_missing_target_column(store_with_dataset: Path, files: TableFiles):
    text = files.edges.read_text().replace("src,dst", "src,target", 1)
    files.edges.write_text(text)
    expect_refused(store_with_dataset, ingest_args(files), files.edges, "dst", None, "missing column", "src, target")


def test_unknown_node_names_the_custom_column(store_with_dataset: Path, files: TableFiles):
    text = files.edges.read_text().replace("src,dst", "from,to", 1)
    files.edges.write_text(text)
    rewrite_line(files.edges, 6, f"{csv_line(files.edges, 6)[0]},44444")
    expect_refused(store_with_dataset, ingest_args(files, None, None, None, "--src-column", "from", "--dst-column",
                                                   "to", "--undirected"),
                   files.edges, "to", 6, "node 44444", via="app")


def test_edges_custom_column_names_missing(store_with_dataset: Path, files: TableFiles):
    expect_refused(store_with_dataset, ingest_args(files, None, None, None, "--src-column", "from"), files.edges,
                   "from", None, "missing column", via="app")


def test_non_integer_edge_endpoint(store_with_dataset: Path, files: TableFiles):
    dst = csv_line(files.edges, 5)[1]
    rewrite_line(files.edges, 5, f"abc,{dst}")
    expect_refused(store_with_dataset, ingest_args(files), files.edges, "src", 5, "'abc'", via="app")


def test_empty_edges_file(store_with_dataset: Path, files: TableFiles):
    files.edges.write_text("")
    expect_refused(store_with_dataset, ingest_args(files), files.edges, None, None, "file is empty")


def test_header_only_nodes_file(store_with_dataset: Path, files: TableFiles):
    files.nodes.write_text("node_id,label\n")
    expect_refused(store_with_dataset, ingest_args(files), files.nodes, None, None, "no rows", via="app")


def test_empty_parquet_file(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = tmp_path / "edges.parquet"
    pq.write_table(pa.table({"src": pa.array([], pa.int64()), "dst": pa.array([], pa.int64())}), path)
    expect_refused(store_with_dataset, ingest_args(files, path), path, None, None, "no rows", via="app")


def test_wrong_file_type_txt(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = tmp_path / "edges.txt"
    shutil.copy(files.edges, path)
    expect_refused(store_with_dataset, ingest_args(files, path), path, None, None, "unsupported file type")


def test_csv_named_parquet(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = tmp_path / "nodes.parquet"
    shutil.copy(files.nodes, path)
    expect_refused(store_with_dataset, ingest_args(files, None, path), path, None, None, "cannot be read as Parquet")


def test_missing_file(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = tmp_path / "nowhere.csv"
    expect_refused(store_with_dataset, ingest_args(files, path), path, None, None, "does not exist", via="app")


# --------------------------------------------------------------------------- features


def test_nan_feature_csv(store_with_dataset: Path, files: TableFiles):
    cells = csv_line(files.features, 3)
    cells[3] = "nan"  # f2
    rewrite_line(files.features, 3, ",".join(cells))
    expect_refused(store_with_dataset, ingest_args(files), files.features, "f2", 3, "NaN")


def test_inf_feature_csv(store_with_dataset: Path, files: TableFiles):
    cells = csv_line(files.features, 2)
    cells[2] = "inf"  # f1
    rewrite_line(files.features, 2, ",".join(cells))
    expect_refused(store_with_dataset, ingest_args(files), files.features, "f1", 2, "inf", "not finite")


def feature_rows(files: TableFiles) -> tuple[list[int], np.ndarray]:
    rows = [line.split(",") for line in files.features.read_text().splitlines()[1:]]
    return [int(r[0]) for r in rows], np.array([[float(v) for v in r[1:]] for r in rows], np.float32)


def test_nan_feature_parquet_columns(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    ids, x = feature_rows(files)
    x[6, 0] = np.nan
    x[9, 1] = np.inf
    path = tmp_path / "features.parquet"
    pq.write_table(pa.table({"node_id": ids, **{f"f{j}": x[:, j] for j in range(x.shape[1])}}), path)
    expect_refused(store_with_dataset, ingest_args(files, None, None, path), path, "f0", 7, "not finite", via="app")


def test_inf_feature_parquet_list_column(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    ids, x = feature_rows(files)
    x[11, 2] = -np.inf
    path = tmp_path / "features.parquet"
    pq.write_table(pa.table({"node_id": ids, "embedding": pa.array(x.tolist(), pa.list_(pa.float32()))}), path)
    expect_refused(store_with_dataset, ingest_args(files, None, None, path), path, "embedding", 12, "-inf",
                   via="app")


def test_ragged_feature_widths_parquet(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    ids, x = feature_rows(files)
    lists = x.tolist()
    lists[4] = lists[4][:3]  # row 5 has width 3
    lists[8] = lists[8] + [1.0]
    path = tmp_path / "features.parquet"
    pq.write_table(pa.table({"node_id": ids, "embedding": pa.array(lists, pa.list_(pa.float32()))}), path)
    expect_refused(store_with_dataset, ingest_args(files, None, None, path), path, "embedding", 5,
                   "ragged feature widths", "row 1 has 4, this row 3")


def test_feature_row_missing_for_a_node(store_with_dataset: Path, files: TableFiles):
    lines = files.features.read_text().splitlines()
    missing = lines[10].split(",")[0]
    files.features.write_text("\n".join(lines[:10] + lines[11:]) + "\n")
    expect_refused(store_with_dataset, ingest_args(files), files.features, "node_id", None,
                   f"no feature row for node {missing}", via="app")


def test_feature_columns_with_a_gap(store_with_dataset: Path, files: TableFiles):
    files.features.write_text(files.features.read_text().replace("f2,f3", "f2,f5", 1))
    expect_refused(store_with_dataset, ingest_args(files), files.features, "f5", None, "f0..f3 without gaps",
                   via="app")


def sparse_json(files: TableFiles, tmp_path: Path, bad: dict[int, object] | None = None) -> Path:
    ids, _ = feature_rows(files)
    payload: dict[str, object] = {str(n): [i % 5, (i + 2) % 5] for i, n in enumerate(ids)}
    for row, value in (bad or {}).items():
        payload[str(ids[row - 1])] = value
    path = tmp_path / "features.json"
    path.write_text(json.dumps(payload))
    return path


def test_sparse_json_features_are_accepted(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = sparse_json(files, tmp_path)
    result = CliRunner().invoke(app, [*ingest_args(files, None, None, path), "--store", str(store_with_dataset)])
    assert result.exit_code == 0, result.exception
    ref = find_dataset(Store.open(store_with_dataset), "broken")
    x = dataset_features(ref)
    assert x.shape == (60, 5) and set(np.unique(x)) == {0.0, 1.0}
    assert np.array_equal(x[0], [1, 0, 1, 0, 0]) and np.array_equal(x[4], [0, 1, 0, 0, 1])  # [i%5, (i+2)%5]


@pytest.mark.parametrize("bad, shown, via", [([1, "x"], "'x'", "cli"), ([0, -2], "-2", "app"),
                                             ({"0": 1}, "{'0': 1}", "app"), ([1.5], "1.5", "app"),
                                             ([True], "True", "app")])
def test_sparse_json_bad_entry(store_with_dataset: Path, files: TableFiles, tmp_path: Path, bad: object, shown: str,
                               via: str):
    path = sparse_json(files, tmp_path, {7: bad, 9: ["y"]})
    expect_refused(store_with_dataset, ingest_args(files, None, None, path), path, "x", 7,
                   "non-negative integer feature ids", shown, via=via)


def test_sparse_json_bad_node_key(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = tmp_path / "features.json"
    path.write_text('{"100": [0], "node-103": [1]}')
    expect_refused(store_with_dataset, ingest_args(files, None, None, path), path, "node_id", 2, "'node-103'",
                   via="app")


def test_sparse_json_not_json(store_with_dataset: Path, files: TableFiles, tmp_path: Path):
    path = tmp_path / "features.json"
    path.write_text('{"100": [0], ')
    expect_refused(store_with_dataset, ingest_args(files, None, None, path), path, None, None,
                   "cannot be read as JSON", via="app")


def test_bad_dataset_name(store_with_dataset: Path, files: TableFiles):
    args = ingest_args(files)
    args[args.index("broken")] = "../escape"
    expect_refused(store_with_dataset, args, Path("--name"), None, None, "not a valid dataset name", via="app")


# --------------------------------------------------------------------------- Planetoid pickles


class _Payload:
    """Pickles to a call of ``os.system`` (never unpickled by the tests; refused by the loader)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def planetoid_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "planetoid"
    shutil.copytree(CORA_DIR, folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


@pytest.mark.parametrize("part, via", [("tx", "cli"), ("graph", "app")])
def test_malicious_planetoid_pickle_is_refused(store_with_dataset: Path, tmp_path: Path, part: str, via: str):
    folder = planetoid_copy(tmp_path)
    marker = tmp_path / "pwned"
    evil = folder / f"ind.cora.{part}"
    evil.write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    message = expect_refused(store_with_dataset, ["ingest", "planetoid", str(folder), "--name", "evil"], evil,
                             None, None, "not allowed", via=via)
    assert "system" in message
    assert not marker.exists(), "the pickle was executed"


def test_pickle_hidden_inside_the_adjacency_dict_is_refused(store_with_dataset: Path, tmp_path: Path):
    import collections

    folder = planetoid_copy(tmp_path)
    marker = tmp_path / "pwned"
    evil = folder / "ind.cora.graph"
    evil.write_bytes(pickle.dumps(collections.defaultdict(list, {0: [1], 1: [_Payload(marker)]}), protocol=2))
    expect_refused(store_with_dataset, ["ingest", "planetoid", str(folder), "--name", "evil"], evil, None, None,
                   "not allowed", via="app")
    assert not marker.exists()


def test_allow_list_unpickler_refuses_in_process(tmp_path: Path):
    """The same refusal without a subprocess: find_class rejects before anything is called."""
    from graphstore.errors import InputError
    from graphstore.ingest.planetoid import safe_load

    marker = tmp_path / "pwned"
    path = tmp_path / "ind.x.tx"
    path.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(InputError, match="not allowed") as info:
        safe_load(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_non_finite_value_in_sparse_planetoid_features(store_with_dataset: Path, tmp_path: Path):
    """The features stay a CSR matrix through validation; the message still names file and row."""
    allx = np.zeros((6, 4), np.float32)
    allx[np.arange(6), np.arange(6) % 4] = 1.0
    allx[3, 2] = np.nan  # data row 4 of allx (node 3)
    ally = np.eye(2, dtype=np.float32)[np.arange(6) % 2]
    folder = write_planetoid(tmp_path / "nan", "nan", allx, ally, 2, np.eye(2, 4, dtype=np.float32),
                             np.eye(2, dtype=np.float32), [6, 7], {i: [(i + 1) % 8] for i in range(8)})
    expect_refused(store_with_dataset, ["ingest", "planetoid", str(folder), "--name", "nan"], folder / "ind.nan.allx",
                   "x", 4, "feature value nan is not finite (feature 2)", via="app")


def test_truncated_planetoid_pickle(store_with_dataset: Path, tmp_path: Path):
    folder = planetoid_copy(tmp_path)
    broken = folder / "ind.cora.allx"
    broken.write_bytes(broken.read_bytes()[:1000])
    expect_refused(store_with_dataset, ["ingest", "planetoid", str(folder), "--name", "cut"], broken, None, None,
                   "not a readable Planetoid pickle", via="app")


def test_planetoid_missing_file(store_with_dataset: Path, tmp_path: Path):
    folder = planetoid_copy(tmp_path)
    (folder / "ind.cora.ty").unlink()
    expect_refused(store_with_dataset, ["ingest", "planetoid", str(folder), "--name", "cut"], folder, None, None,
                   "missing files: ty", via="app")
