"""Ingestion behaviour: no-op re-ingest, versions, stable fingerprints, Planetoid padding, OGB folders."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import (
    CORA_DIR,
    TableFiles,
    dataset_features,
    flat,
    ingest_table_files,
    run_cli,
    snapshot,
    table_rows,
    write_planetoid,
    write_tables,
)
from cli.app import app
from graphstore.sql_query import query
from graphstore.errors import InputError
from graphstore.ingest.api import ingest_ogb, ingest_planetoid, ingest_synthetic, ingest_tables
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.synthetic import SyntheticOptions
from graphstore.ingest.tables import TableOptions
from graphstore.layout import Store
from graphstore.lookup import find_dataset
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions


def tables_args(files: TableFiles, name: str = "mine", *extra: str) -> list[str]:
    return ["ingest", "tables", "--name", name, "--edges", str(files.edges), "--nodes", str(files.nodes),
            "--features", str(files.features), *extra]


def dataset_fps(stdout: str) -> list[str]:
    return [row[1] for row in table_rows(stdout)]


# --------------------------------------------------------------------------- re-ingest and versions


def test_reingesting_an_unchanged_source_is_a_no_op(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    store = tmp_path / "store"
    first = run_cli(*tables_args(files), store=store)
    assert first.returncode == 0, first.stderr
    assert "written" in flat(first.stdout)
    before = snapshot(store / "datasets")
    second = run_cli(*tables_args(files), store=store)
    assert second.returncode == 0, second.stderr
    assert "unchanged (already in the store)" in flat(second.stdout)
    assert dataset_fps(first.stdout) == dataset_fps(second.stdout)
    assert snapshot(store / "datasets") == before  # nothing rewritten: same files, sizes, mtimes


def test_reingest_in_process_returns_created_false(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    store = Store.open(tmp_path / "store")
    first = ingest_table_files(store, files)
    mtimes = {p: p.stat().st_mtime_ns for p in first.path.iterdir()}
    again = ingest_table_files(store, files)
    assert first.created and not again.created
    assert (again.fp, again.path) == (first.fp, first.path)
    assert {p: p.stat().st_mtime_ns for p in first.path.iterdir()} == mtimes


def test_copied_source_files_keep_the_fingerprint(tmp_path: Path):
    """The fingerprint is over content and options, not over where the files are."""
    files = write_tables(tmp_path / "a")
    moved = tmp_path / "b"
    shutil.copytree(files.edges.parent, moved)
    store = Store.open(tmp_path / "store")
    first = ingest_table_files(store, files)
    again = ingest_table_files(store, TableFiles(moved / "edges.csv", moved / "nodes.csv", moved / "features.csv"))
    assert again.fp == first.fp and not again.created


def test_changed_source_gets_a_new_fingerprint_and_both_stay_queryable(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    store = tmp_path / "store"
    first = run_cli(*tables_args(files), store=store)
    assert first.returncode == 0, first.stderr
    old_files = {k: v for k, v in snapshot(store / "datasets").items() if v[0] >= 0}  # files, not folders
    lines = files.features.read_text().splitlines()
    lines[5] = lines[5].split(",")[0] + ",9,9,9,9"
    files.features.write_text("\n".join(lines) + "\n")
    second = run_cli(*tables_args(files), store=store)
    assert second.returncode == 0, second.stderr
    (fp1,), (fp2,) = dataset_fps(first.stdout), dataset_fps(second.stdout)
    assert fp1 != fp2
    after = snapshot(store / "datasets")
    assert {k: v for k, v in after.items() if k in old_files} == old_files  # the old version is untouched

    st = Store.open(store)
    _cols, rows = query(st, "SELECT name, fp, num_nodes FROM datasets ORDER BY created_at")
    assert rows == [("mine", fp1, 60), ("mine", fp2, 60)]
    _cols, rows = query(st, "SELECT dataset, count(*) FROM nodes GROUP BY dataset ORDER BY dataset")
    assert dict(rows) == {fp1: 60, fp2: 60}
    assert find_dataset(st, "mine").fp == fp2  # the name means the newest version
    assert find_dataset(st, fp1).fp == fp1  # the old one by its fingerprint



def test_changed_options_change_the_fingerprint(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    store = Store.open(tmp_path / "store")
    fps = {
        ingest_tables(store, "mine", files.edges, files.nodes, files.features, options, fractions).fp
        for options, fractions in [
            (TableOptions(), SplitFractions()),
            (TableOptions(undirected=True), SplitFractions()),
            (TableOptions(), SplitFractions(seed=1)),
            (TableOptions(), SplitFractions(train=0.5)),
        ]
    }
    assert len(fps) == 4


def test_undirected_tables_are_stored_both_ways(tmp_path: Path):
    files = write_tables(tmp_path / "input")
    store = Store.open(tmp_path / "store")
    ref = ingest_table_files(store, files, undirected=True)
    edges = pq.read_table(ref.path / "edges.parquet")
    pairs = set(zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist()))
    assert all((d, s) in pairs for s, d in pairs)
    assert len(pairs) == ref.num_edges  # deduplicated
    manifest = json.loads((ref.path / "manifest.json").read_text())
    assert manifest["symmetric"] is True
    nodes = pq.read_table(ref.path / "nodes.parquet")
    assert nodes.column("site").to_pylist()[:2] == ["a", "a"]  # extra columns are kept


def test_a_site_keeps_the_edges_into_its_nodes_with_remote_sources_by_id(tmp_path: Path):
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "nodes.csv").write_text("node_id,label\n10,0\n11,1\n")
    (folder / "edges.csv").write_text("src,dst\n10,11\n900,10\n11,901\n900,10\n")  # 11->901: remote target
    refused = run_cli("ingest", "tables", "--edges", folder / "edges.csv", "--nodes", folder / "nodes.csv",
                      "--name", "site", "--remote-sources", store=tmp_path / "store")
    assert refused.returncode == 2
    assert "edges.csv, column 'dst', row 3: edge refers to node 901" in refused.stderr
    assert "a site's edges must end at its own nodes" in refused.stderr
    ref = ingest_tables(Store.open(tmp_path / "store"), "site", folder / "edges.csv", folder / "nodes.csv", None,
                        TableOptions(remote_sources=True, undirected=True), SplitFractions())
    edges = pq.read_table(ref.path / "edges.parquet")
    # undirected: each edge kept in the direction that ends here; 10<->11 both ways, 901 dropped
    assert sorted(zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist())) == [
        (10, 11), (11, 10), (900, 10), (901, 11)]
    manifest = ref.manifest
    assert (manifest.remote_nodes, manifest.symmetric, manifest.duplicates_removed) == (2, False, 1)
    files = write_tables(tmp_path / "plain")
    plain, site = (ingest_tables(Store.open(tmp_path / s), "tiny", files.edges, files.nodes, files.features,
                                 TableOptions(remote_sources=r), SplitFractions()) for s, r in (("a", False), ("b", True)))
    assert plain.fp != site.fp and plain.num_edges == site.num_edges  # an option of the fingerprint


# --------------------------------------------------------------------------- fingerprints


def test_fingerprints_are_stable_across_processes(cora, tmp_path: Path):
    """Same source -> same dataset and partition fingerprints, whatever the hash seed or store."""
    fps = []
    for seed in ("1", "2"):
        store = tmp_path / f"store{seed}"
        env = {"PYTHONHASHSEED": seed}
        ingest = run_cli("ingest", "planetoid", str(CORA_DIR), "--name", "cora", store=store, env=env)
        assert ingest.returncode == 0, ingest.stderr
        part = run_cli("partition", "cora", "--method", "metis", "--parts", "4", "--seed", "0", store=store, env=env)
        assert part.returncode == 0, part.stderr
        _cols, rows = query(Store.open(store), "SELECT dataset, partition FROM partitions")
        fps.append(rows)
    assert fps[0] == fps[1] == [(cora.dataset.fp, cora.partitions["metis"].fp)]


def test_synthetic_is_deterministic(tmp_path: Path):
    options = SyntheticOptions(nodes=500, avg_degree=6, classes=3, features=4, seed=5)
    refs = [ingest_synthetic(Store.open(tmp_path / f"s{i}"), "sbm", options, SplitFractions()) for i in range(2)]
    assert refs[0].fp == refs[1].fp
    assert refs[0].num_edges == 500 * 6
    for table in ("nodes", "edges", "features"):
        assert pq.read_table(refs[0].path / f"{table}.parquet").equals(pq.read_table(refs[1].path / f"{table}.parquet"))
    other = ingest_synthetic(Store.open(tmp_path / "s0"), "sbm", options.model_copy(update={"seed": 6}), SplitFractions())
    assert other.fp != refs[0].fp


# --------------------------------------------------------------------------- store ls


def test_store_ls_lists_artefacts(tmp_path: Path):
    store = tmp_path / "store"
    dataset = ingest_planetoid(Store.open(store), CORA_DIR, "cora")
    build_partition(Store.open(store), dataset, PartitionOptions(method="random", parts=2))
    listing = run_cli("store", "ls", store=store)
    assert listing.returncode == 0, listing.stderr
    rows = table_rows(listing.stdout)
    assert [(r[0], r[1]) for r in rows] == [("dataset", "cora"), ("partition", "cora")]
    _cols, fps = query(Store.open(store), "SELECT dataset, partition FROM partitions")
    (dataset_fp, partition_fp), = fps
    assert rows[0][2] == dataset_fp and rows[1][2] == partition_fp
    assert rows[0][5] == f"datasets/name=cora/fp={dataset_fp}"
    assert rows[1][5] == f"partitions/dataset={dataset_fp}/fp={partition_fp}"
    assert all(r[3].endswith("KB") for r in rows)


def test_store_ls_on_an_empty_store(tmp_path: Path):
    listing = run_cli("store", "ls", store=tmp_path / "store")
    assert listing.returncode == 0, listing.stderr
    assert table_rows(listing.stdout) == []


# --------------------------------------------------------------------------- Planetoid


def citeseer_like(folder: Path, protocol: int = 2) -> dict[str, object]:
    """10 train/val rows (allx), test indices 10..17 of which 12 and 15 have no feature row."""
    rng = np.random.default_rng(0)
    allx = (rng.random((10, 6)) < 0.4).astype(np.float32)
    ally = np.eye(3, dtype=np.float32)[np.arange(10) % 3]
    test_index = [17, 10, 14, 11, 16, 13]  # file order; 12 and 15 are missing (isolated in CiteSeer)
    tx = (rng.random((6, 6)) < 0.4).astype(np.float32) + np.arange(6)[:, None]  # row i identifies test_index[i]
    ty = np.eye(3, dtype=np.float32)[[2, 0, 1, 1, 0, 2]]
    graph = {i: [(i + 1) % 18, (i + 5) % 18] for i in range(18) if i not in (12, 15)}
    write_planetoid(folder, "tiny", allx, ally, 4, tx, ty, test_index, graph, protocol=protocol)
    return {"allx": allx, "ally": ally, "tx": tx, "ty": ty, "test_index": test_index}


@pytest.mark.parametrize("protocol", [2, 4])
def test_planetoid_test_index_without_feature_row_is_padded(tmp_path: Path, protocol: int):
    source = citeseer_like(tmp_path / "tiny", protocol)
    ref = ingest_planetoid(Store.open(tmp_path / "store"), tmp_path / "tiny", "tiny")
    assert (ref.num_nodes, ref.num_features, ref.num_classes) == (18, 6, 3)
    nodes = pq.read_table(ref.path / "nodes.parquet").to_pydict()
    x = dataset_features(ref)
    label, split = np.array(nodes["label"]), np.array(nodes["split"])
    assert nodes["node_id"] == list(range(18))
    for padded in (12, 15):
        assert label[padded] == -1 and split[padded] == "none"
        assert not x[padded].any()
    for i, node in enumerate(source["test_index"]):  # tx/ty row i belongs to test_index[i]
        assert np.array_equal(x[node], source["tx"][i])
        assert label[node] == int(np.argmax(source["ty"][i]))
        assert split[node] == "test"
    assert np.array_equal(x[:10], source["allx"])
    assert list(label[:10]) == [i % 3 for i in range(10)]
    assert list(split[:10]) == ["train"] * 4 + ["val"] * 6


def test_planetoid_prefix_is_found_from_the_files(tmp_path: Path):
    citeseer_like(tmp_path / "tiny")
    result = run_cli("ingest", "planetoid", str(tmp_path / "tiny"), "--name", "tiny", store=tmp_path / "store")
    assert result.returncode == 0, result.stderr
    assert table_rows(result.stdout)[0][2:] == ["18", "64", "6", "3"]  # 32 undirected edges, both ways


# --------------------------------------------------------------------------- OGB


def write_gz(path: Path, rows: list[list[object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as handle:  # no header, as in OGB's raw files
        handle.write("".join(",".join(map(str, row)) + "\n" for row in rows))


def write_ogb_arxiv(root: Path, num_nodes: int = 30) -> dict[str, np.ndarray]:
    """A tiny ``ogbn-arxiv`` in OGB's on-disk layout (see ogb/io/read_graph_raw.py)."""
    rng = np.random.default_rng(1)
    folder = root / "ogbn_arxiv"
    edges = np.array([[i, (i * 7 + 3) % num_nodes] for i in range(num_nodes)] + [[0, 1], [1, 0]])
    edges = edges[edges[:, 0] != edges[:, 1]]
    x = rng.standard_normal((num_nodes, 5)).round(4).astype(np.float32)
    y = rng.integers(0, 40, num_nodes)
    (folder / "raw").mkdir(parents=True)
    (folder / "RELEASE_v1.txt").write_text("ogbn-arxiv test folder\n")
    write_gz(folder / "raw/edge.csv.gz", edges.tolist())
    write_gz(folder / "raw/num-node-list.csv.gz", [[num_nodes]])
    write_gz(folder / "raw/num-edge-list.csv.gz", [[len(edges)]])
    write_gz(folder / "raw/node-feat.csv.gz", x.tolist())
    write_gz(folder / "raw/node-label.csv.gz", [[v] for v in y])
    write_gz(folder / "raw/node_year.csv.gz", [[2010 + i % 10] for i in range(num_nodes)])
    order = rng.permutation(num_nodes)
    for name, idx in (("train", order[:15]), ("valid", order[15:22]), ("test", order[22:])):
        write_gz(folder / f"split/time/{name}.csv.gz", [[i] for i in idx])
    return {"edges": edges, "x": x, "y": y, "train": order[:15], "valid": order[15:22], "test": order[22:]}


def test_ogb_folder_is_ingested(tmp_path: Path):
    source = write_ogb_arxiv(tmp_path / "ogb")
    # ogb would torch.load split/<split>/split_dict.pt (a pickle) if present: it must never see it
    (tmp_path / "ogb/ogbn_arxiv/split/time/split_dict.pt").write_bytes(b"not a pickle at all")
    before = snapshot(tmp_path / "ogb")
    store = tmp_path / "store"
    # in-process through the CLI's typer app: ogb imports torch, which this test process may have already
    args = ["ingest", "ogb", str(tmp_path / "ogb"), "--name", "ogbn-arxiv", "--undirected", "--store", str(store)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert snapshot(tmp_path / "ogb") == before  # ogb's processed cache did not land in the user's folder
    ref = find_dataset(Store.open(store), "ogbn-arxiv")
    pairs = {tuple(e) for e in source["edges"].tolist()} | {(d, s) for s, d in source["edges"].tolist()}
    assert (ref.num_nodes, ref.num_edges, ref.num_features, ref.num_classes) == (30, len(pairs), 5, 40)
    edges = pq.read_table(ref.path / "edges.parquet")
    assert set(zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist())) == pairs
    nodes = pq.read_table(ref.path / "nodes.parquet").to_pydict()
    assert nodes["label"] == source["y"].tolist()
    split = np.array(nodes["split"])
    for key, name in (("train", "train"), ("valid", "val"), ("test", "test")):
        assert set(np.flatnonzero(split == name).tolist()) == set(source[key].tolist())
    x = dataset_features(ref)
    assert np.allclose(x, source["x"])
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "unchanged" in flat(again.output)


def test_incomplete_ogb_folder_is_refused_without_prompting(tmp_path: Path):
    """Without RELEASE_v1.txt ogb itself would ask on stdin whether to update; we refuse first."""
    write_ogb_arxiv(tmp_path / "ogb")
    (tmp_path / "ogb/ogbn_arxiv/RELEASE_v1.txt").unlink()
    store = tmp_path / "store"
    result = run_cli("ingest", "ogb", str(tmp_path / "ogb"), "--name", "ogbn-arxiv", store=store, timeout=60)
    assert result.returncode == 2, result.stderr
    message = flat(result.stderr)
    assert "OGB layout incomplete, missing: RELEASE_v1.txt" in message, message
    assert str(tmp_path / "ogb/ogbn_arxiv") in message
    assert "Traceback" not in result.stderr and "(y/N)" not in result.stdout
    assert not (store / "datasets").exists()


@pytest.mark.parametrize("remove", ["raw/node-feat.csv.gz", "split/time/valid.csv.gz", "raw/node_year.csv.gz",
                                    "raw/edge.csv.gz"])
def test_every_required_ogb_file_is_checked(tmp_path: Path, remove: str):
    write_ogb_arxiv(tmp_path / "ogb")
    (tmp_path / "ogb/ogbn_arxiv" / remove).unlink()
    with pytest.raises(InputError, match=f"OGB layout incomplete, missing: {remove}"):
        ingest_ogb(Store.open(tmp_path / "store"), tmp_path / "ogb", "ogbn-arxiv")
    assert not (tmp_path / "store/datasets").exists()


def test_unknown_ogb_name_is_refused(tmp_path: Path):
    with pytest.raises(InputError, match="not an OGB node-property data set; known: ogbn-proteins"):
        ingest_ogb(Store.open(tmp_path / "store"), tmp_path, "ogbn-nope")


def test_missing_ogb_dataset_folder(tmp_path: Path):
    (tmp_path / "ogb").mkdir()
    with pytest.raises(InputError, match="expected a folder 'ogbn_arxiv'"):
        ingest_ogb(Store.open(tmp_path / "store"), tmp_path / "ogb", "ogbn-arxiv")


def test_readme_worked_example(tmp_path: Path):
    """The 'Bring your own graph' example of the README gives the partition table it shows."""
    (tmp_path / "edges.csv").write_text("src,dst\n10,11\n11,12\n12,10\n12,13\n13,14\n14,15\n15,13\n")
    (tmp_path / "nodes.csv").write_text("node_id,label,split,site\n10,0,train,berlin\n11,0,val,berlin\n"
                                        "12,0,test,berlin\n13,1,train,paris\n14,1,val,paris\n15,1,test,paris\n")
    (tmp_path / "features.json").write_text('{"10": [0, 2], "11": [0], "12": [1, 2], "13": [3], "14": [3, 4], "15": []}')
    store = Store.open(tmp_path / "store")
    ref = ingest_tables(store, "sites", tmp_path / "edges.csv", tmp_path / "nodes.csv", tmp_path / "features.json",
                        TableOptions(undirected=True), SplitFractions())
    assert (ref.num_nodes, ref.num_edges, ref.num_features, ref.num_classes) == (6, 14, 5, 2)
    build_partition(store, ref, PartitionOptions(method="column", column="site", parts=2))
    _cols, rows = query(store, "SELECT part, owned_nodes, local_edges, cut_edges, halo_nodes, train, val, test "
                               "FROM partition_stats JOIN partitions USING (partition) "
                               "WHERE dataset_name = 'sites' AND method = 'column' ORDER BY part")
    assert rows == [(0, 3, 6, 1, 1, 1, 1, 1), (1, 3, 6, 1, 1, 1, 1, 1)]
    _cols, rows = query(store, "SELECT part, node_id, owner FROM halo ORDER BY part")
    assert rows == [(0, 13, 1), (1, 12, 0)]
