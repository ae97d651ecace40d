"""Partition invariants (README "Bring your own graph" and "The store") on Cora, a synthetic SBM and a site-column graph.

For every method: each node is owned by exactly one part; part i's edges are exactly the dataset
edges whose ``dst`` it owns; its halo is exactly the set of remote sources of those edges, with
their true owners; stats rows and manifest totals agree with the files; the DuckDB views agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import GRAPH_METHODS, PartitionedGraph, dataset_features, dense_features
from graphstore.sql_query import query
from graphstore.layout import Store
from graphstore.lookup import PartitionRef
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions

CASES = [(graph, method) for graph in ("cora", "synthetic_graph") for method in GRAPH_METHODS]
CASES.append(("site_graph", "column"))


@dataclass
class PartFiles:
    nodes: list[dict[str, np.ndarray]]
    edges: list[tuple[np.ndarray, np.ndarray]]
    halo: list[tuple[np.ndarray, np.ndarray]]
    assignment: dict[int, int]


def read_parts(ref: PartitionRef) -> PartFiles:
    nodes, edges, halo = [], [], []
    width = ref.manifest.num_features
    for i in range(ref.parts):
        part = ref.path / f"part={i}"
        table = pq.read_table(part / "nodes.parquet")
        nodes.append({
            "node_id": table.column("node_id").to_numpy(),
            "label": table.column("label").to_numpy(),
            "split": table.column("split").to_numpy(zero_copy_only=False),
            "x": dense_features(table, width),
        })
        e = pq.read_table(part / "edges.parquet")
        edges.append((e.column("src").to_numpy(), e.column("dst").to_numpy()))
        h = pq.read_table(part / "halo.parquet")
        halo.append((h.column("node_id").to_numpy(), h.column("owner").to_numpy()))
    a = pq.read_table(ref.path / "assignment.parquet")
    assignment = dict(zip(a.column("node_id").to_numpy().tolist(), a.column("part").to_numpy().tolist()))
    return PartFiles(nodes, edges, halo, assignment)


def dataset_edges(graph: PartitionedGraph) -> tuple[np.ndarray, np.ndarray]:
    e = pq.read_table(graph.dataset.path / "edges.parquet")
    return e.column("src").to_numpy(), e.column("dst").to_numpy()


def dataset_nodes(graph: PartitionedGraph) -> dict[str, np.ndarray]:
    n = pq.read_table(graph.dataset.path / "nodes.parquet")
    return {
        "node_id": n.column("node_id").to_numpy(),
        "label": n.column("label").to_numpy(),
        "split": n.column("split").to_numpy(zero_copy_only=False),
        "x": dataset_features(graph.dataset),
    }


def sorted_pairs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    pairs = np.stack([src, dst], axis=1)
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]


@pytest.fixture(params=CASES, ids=[f"{g}-{m}" for g, m in CASES])
def case(request: pytest.FixtureRequest) -> tuple[PartitionedGraph, PartitionRef, PartFiles]:
    graph_name, method = request.param
    graph: PartitionedGraph = request.getfixturevalue(graph_name)
    ref = graph.partitions[method]
    return graph, ref, read_parts(ref)


def test_every_node_owned_by_exactly_one_part(case):
    graph, ref, files = case
    nodes = dataset_nodes(graph)
    owned = np.concatenate([part["node_id"] for part in files.nodes])
    assert len(owned) == graph.dataset.num_nodes
    assert np.array_equal(np.sort(owned), np.sort(nodes["node_id"]))  # no node twice, none missing
    for i, part in enumerate(files.nodes):
        assert all(files.assignment[n] == i for n in part["node_id"].tolist())
    assert set(files.assignment) == set(nodes["node_id"].tolist())


def test_owned_nodes_carry_their_labels_splits_and_features(case):
    graph, _ref, files = case
    nodes = dataset_nodes(graph)
    for part in files.nodes:
        rows = np.searchsorted(nodes["node_id"], part["node_id"])
        assert np.array_equal(nodes["node_id"][rows], part["node_id"])
        assert np.array_equal(nodes["label"][rows], part["label"])
        assert np.array_equal(nodes["split"][rows], part["split"])
        assert np.array_equal(nodes["x"][rows], part["x"])


def test_local_edges_are_exactly_the_dataset_edges(case):
    graph, _ref, files = case
    src = np.concatenate([s for s, _ in files.edges])
    dst = np.concatenate([d for _, d in files.edges])
    assert np.array_equal(sorted_pairs(src, dst), sorted_pairs(*dataset_edges(graph)))  # multiset equality
    for i, (_, d) in enumerate(files.edges):
        assert all(files.assignment[v] == i for v in d.tolist()), f"part {i} holds an edge whose dst it does not own"


def test_halo_is_exactly_the_remote_sources_with_owners(case):
    _graph, ref, files = case
    for i in range(ref.parts):
        src, _dst = files.edges[i]
        expected = sorted({u for u in src.tolist() if files.assignment[u] != i})
        halo_ids, owners = files.halo[i]
        assert sorted(halo_ids.tolist()) == expected
        assert len(set(halo_ids.tolist())) == len(halo_ids)
        assert all(files.assignment[n] == o != i for n, o in zip(halo_ids.tolist(), owners.tolist()))


def test_stats_rows_agree_with_files(case):
    _graph, ref, files = case
    manifest = json.loads((ref.path / "manifest.json").read_text())
    stats = pq.read_table(ref.path / "stats.parquet").to_pylist()
    assert [s["part"] for s in stats] == list(range(ref.parts))
    mean = sum(len(p["node_id"]) for p in files.nodes) / ref.parts
    for i, row in enumerate(stats):
        part, (src, _), (halo_ids, _) = files.nodes[i], files.edges[i], files.halo[i]
        own = set(part["node_id"].tolist())
        local = sum(u in own for u in src.tolist())
        assert row["owned_nodes"] == len(part["node_id"])
        assert row["local_edges"] == local
        assert row["cut_edges"] == len(src) - local
        assert row["halo_nodes"] == len(halo_ids)
        for split in ("train", "val", "test"):
            assert row[split] == int(np.count_nonzero(part["split"] == split))
        assert row["balance"] == pytest.approx(len(part["node_id"]) / mean, abs=1e-4)
    assert manifest["stats"] == stats
    assert ref.edge_cut == manifest["edge_cut"] == sum(s["cut_edges"] for s in stats)
    assert ref.halo_total == manifest["halo_total"] == sum(s["halo_nodes"] for s in stats)


def test_catalog_views_agree(case):
    """The same invariants through the DuckDB views (one query, so the catalog is refreshed once)."""
    graph, ref, _files = case
    p, d = ref.fp, ref.dataset_fp
    checks = {
        "partition_nodes rows": f"SELECT count(*) FROM partition_nodes WHERE partition = '{p}'",
        "distinct owned nodes": f"SELECT count(DISTINCT node_id) FROM partition_nodes WHERE partition = '{p}'",
        "dataset nodes": f"SELECT count(*) FROM nodes WHERE dataset = '{d}'",
        "partition_edges rows": f"SELECT count(*) FROM partition_edges WHERE partition = '{p}'",
        "dataset edges": f"SELECT count(*) FROM edges WHERE dataset = '{d}'",
        # multiset difference of (src, dst), both ways
        "edges differing": f"""SELECT count(*) FROM (
            (SELECT src, dst FROM partition_edges WHERE partition = '{p}'
             EXCEPT ALL SELECT src, dst FROM edges WHERE dataset = '{d}')
            UNION ALL
            (SELECT src, dst FROM edges WHERE dataset = '{d}'
             EXCEPT ALL SELECT src, dst FROM partition_edges WHERE partition = '{p}'))""",
        # halo == remote sources of the part's edges, with the owner taken from partition_nodes
        "halo differing": f"""WITH remote AS (
                SELECT DISTINCT e.part, e.src AS node_id, o.part AS owner
                FROM partition_edges e JOIN partition_nodes o ON o.partition = e.partition AND o.node_id = e.src
                WHERE e.partition = '{p}' AND o.part <> e.part),
            halo_rows AS (SELECT part, node_id, owner FROM halo WHERE partition = '{p}')
            SELECT count(*) FROM ((FROM remote EXCEPT ALL FROM halo_rows) UNION ALL
                                  (FROM halo_rows EXCEPT ALL FROM remote))""",
        "edges with foreign dst": f"""SELECT count(*) FROM partition_edges e LEFT JOIN partition_nodes o
            ON o.partition = e.partition AND o.node_id = e.dst AND o.part = e.part
            WHERE e.partition = '{p}' AND o.node_id IS NULL""",
        "halo rows": f"SELECT count(*) FROM halo WHERE partition = '{p}'",
        "stats rows matching owned counts": f"""SELECT count(*) FROM partition_stats s JOIN (
                SELECT part, count(*) AS n FROM partition_nodes WHERE partition = '{p}' GROUP BY part) c
            USING (part) WHERE s.partition = '{p}' AND s.owned_nodes = c.n""",
        "stats cut edges": f"SELECT sum(cut_edges) FROM partition_stats WHERE partition = '{p}'",
        "stats halo nodes": f"SELECT sum(halo_nodes) FROM partition_stats WHERE partition = '{p}'",
        "partitions row": f"""SELECT concat_ws(' ', method, parts, edge_cut, halo_total) FROM partitions
            WHERE partition = '{p}'""",
    }
    columns, rows = query(graph.store, "SELECT " + ", ".join(f'({sql}) AS "{name}"' for name, sql in checks.items()))
    got = dict(zip(columns, rows[0]))
    n, e = graph.dataset.num_nodes, graph.dataset.num_edges
    assert got == {
        "partition_nodes rows": n, "distinct owned nodes": n, "dataset nodes": n,
        "partition_edges rows": e, "dataset edges": e, "edges differing": 0, "halo differing": 0,
        "edges with foreign dst": 0, "halo rows": ref.halo_total, "stats rows matching owned counts": ref.parts,
        "stats cut edges": ref.edge_cut, "stats halo nodes": ref.halo_total,
        "partitions row": f"{ref.method} {ref.parts} {ref.edge_cut} {ref.halo_total}",
    }


def test_metis_cuts_fewer_edges_than_random_on_cora(cora):
    metis, random = cora.partitions["metis"], cora.partitions["random"]
    assert metis.edge_cut < random.edge_cut / 2, (metis.edge_cut, random.edge_cut)
    supernode = cora.partitions["supernode"]
    assert metis.edge_cut < supernode.edge_cut


def test_cora_dataset_statistics(cora):
    d = cora.dataset
    assert (d.num_nodes, d.num_edges, d.num_features, d.num_classes) == (2708, 10556, 1433, 7)
    _cols, rows = query(cora.store, f"SELECT split, count(*) FROM nodes WHERE dataset = '{d.fp}' GROUP BY split ORDER BY split")
    assert dict(rows) == {"train": 140, "val": 500, "test": 1000, "none": 1068}


def test_column_partition_follows_the_site_column(site_graph):
    ref = site_graph.partitions["column"]
    nodes = pq.read_table(site_graph.dataset.path / "nodes.parquet")
    sites = dict(zip(nodes.column("node_id").to_pylist(), nodes.column("site").to_pylist()))
    files = read_parts(ref)
    for i, part in enumerate(files.nodes):
        assert {sites[n] for n in part["node_id"].tolist()} == {"abc"[i]}  # sorted distinct values -> 0, 1, 2


@pytest.mark.parametrize("method", ["random", "metis", "supernode"])
def test_same_seed_gives_identical_assignment(cora, tmp_path: Path, method: str):
    other = Store.open(tmp_path)
    from graphstore.ingest.api import ingest_planetoid
    from conftest import CORA_DIR

    dataset = ingest_planetoid(other, CORA_DIR, "cora")
    assert dataset.fp == cora.dataset.fp
    again = build_partition(other, dataset, PartitionOptions(method=method, parts=4, seed=0))
    first = cora.partitions[method]
    assert again.created and again.fp == first.fp
    a = pq.read_table(first.path / "assignment.parquet")
    b = pq.read_table(again.path / "assignment.parquet")
    assert a.equals(b)
    for i in range(4):
        for table in ("nodes", "edges", "halo"):
            assert pq.read_table(first.path / f"part={i}/{table}.parquet").equals(
                pq.read_table(again.path / f"part={i}/{table}.parquet"))


def test_different_seed_gives_a_different_partition(cora):
    other = build_partition(cora.store, cora.dataset, PartitionOptions(method="random", parts=4, seed=7))
    first = cora.partitions["random"]
    assert other.fp != first.fp
    a = pq.read_table(first.path / "assignment.parquet").column("part").to_numpy()
    b = pq.read_table(other.path / "assignment.parquet").column("part").to_numpy()
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("method", GRAPH_METHODS)
def test_rerun_is_a_no_op(synthetic_graph, method: str):
    first = synthetic_graph.partitions[method]
    before = {p: p.stat().st_mtime_ns for p in first.path.rglob("*")}
    again = build_partition(synthetic_graph.store, synthetic_graph.dataset, PartitionOptions(method=method, parts=5, seed=1))
    assert not again.created
    assert (again.fp, again.path, again.edge_cut, again.halo_total) == (first.fp, first.path, first.edge_cut, first.halo_total)
    assert {p: p.stat().st_mtime_ns for p in first.path.rglob("*")} == before


def test_partition_cli_rerun_reports_unchanged(cora):
    from conftest import flat, run_cli

    result = run_cli("partition", "cora", "--method", "metis", "--parts", "4", store=cora.store.root)
    assert result.returncode == 0, result.stderr
    out = flat(result.stdout)
    assert f"partition {cora.partitions['metis'].fp} (metis, 4 parts): unchanged (already in the store)" in out
