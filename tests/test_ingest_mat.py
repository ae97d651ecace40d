"""``retexo ingest mat``: an adjacency matrix saved by MATLAB (SEAL's link-prediction benchmarks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse

from conftest import run_cli
from graphstore.ingest.api import ingest_mat
from graphstore.layout import Store
from graphstore.parquet_io import features_of, read_table


def saved(path: Path, **arrays: object) -> Path:
    scipy.io.savemat(path, arrays)
    return path


def stored_edges(ref) -> set[tuple[int, int]]:
    edges = read_table(ref.path / "edges.parquet")
    return set(zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist()))


def test_a_symmetric_matrix_is_an_undirected_graph_with_identity_features(tmp_path) -> None:
    net = scipy.sparse.csc_matrix(np.array([[0, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 1], [0, 0, 1, 0]], float))
    store = Store.open(tmp_path / "store")
    ref = ingest_mat(store, saved(tmp_path / "g.mat", net=net), "g")
    # every off-diagonal entry, the self loop (2, 2) dropped
    assert stored_edges(ref) == {(0, 1), (1, 0), (0, 2), (2, 0), (2, 3), (3, 2)}
    assert (ref.num_nodes, ref.num_features, ref.num_classes) == (4, 4, 0)
    x = features_of(read_table(ref.path / "features.parquet"), 4)
    assert (x != scipy.sparse.identity(4, format="csr")).nnz == 0
    labels = read_table(ref.path / "nodes.parquet").column("label").to_numpy()
    assert (labels == -1).all()
    assert ingest_mat(store, tmp_path / "g.mat", "g").created is False  # the same file: unchanged


def test_an_asymmetric_matrix_keeps_its_directions(tmp_path) -> None:
    net = np.array([[0, 1, 0], [0, 0, 1], [0, 0, 0]], float)
    ref = ingest_mat(Store.open(tmp_path / "store"), saved(tmp_path / "d.mat", adj=net, name=np.array([1.0])), "d")
    assert stored_edges(ref) == {(0, 1), (1, 2)}


def test_bad_mat_files_are_one_line_naming_the_file_and_exit_2(tmp_path) -> None:
    store = tmp_path / "store"
    (tmp_path / "text.mat").write_text("not matlab\n")
    two = saved(tmp_path / "two.mat", a=np.eye(3), b=np.eye(2))
    wide = saved(tmp_path / "wide.mat", net=np.ones((2, 3)))
    for args, expected in (
        ([tmp_path / "missing.mat"], "missing.mat: file does not exist"),
        ([tmp_path / "text.mat"], "text.mat: not a MATLAB .mat file"),
        ([two], "two.mat: expected one adjacency matrix, found ['a', 'b']: pass --key"),
        ([two, "--key", "c"], "two.mat: no variable 'c' (the file holds a, b)"),
        ([wide], "wide.mat: net: expected a square N x N adjacency matrix, got shape (2, 3)"),
    ):
        result = run_cli("ingest", "mat", *args, "--name", "bad", store=store)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
