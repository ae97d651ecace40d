"""Stable partitions across dataset versions (``stable_from``): old nodes keep their part, new
nodes are placed by the method, ``previous`` finds the anchor in the previous version and a
repeated build is cached. Two real versions of a small tables graph (``write_table_version``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import flat, ingest_table_files, run_cli, write_table_version
from graphstore.sql_query import query
from graphstore.errors import StoreError
from graphstore.layout import Store
from graphstore.lookup import DatasetRef, PartitionRef, find_partition, partition_fingerprint, resolve_stable_from
from graphstore.manifests import PartitionManifest
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.partition.stable import UNPLACED, balanced_quotas, fill_balanced, grow_from_neighbours

NAME = "nightly"


@dataclass(frozen=True)
class Versions:
    store: Store
    v1: DatasetRef
    v2: DatasetRef


def ingest_versions(root: Path) -> Versions:
    """Version 1, then version 2 (v1 + 5 % new nodes) of the same dataset name."""
    store = Store.open(root / "store")
    v1 = ingest_table_files(store, write_table_version(root / "v1", 1), name=NAME)
    v2 = ingest_table_files(store, write_table_version(root / "v2", 2), name=NAME)
    return Versions(store, v1, v2)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    return ingest_versions(tmp_path_factory.mktemp("stable"))


@pytest.fixture
def fresh_versions(tmp_path: Path) -> Versions:
    """Versions in a private store, for tests that depend on which partitions exist."""
    return ingest_versions(tmp_path)


def options_for(method: str, **update: object) -> PartitionOptions:
    """Options of the tests: 4 parts, seed 0 (``column``: the 3 sites), with ``update`` on top."""
    base: dict[str, object] = {"method": "column", "column": "site", "parts": 3} if method == "column" else {
        "method": method, "parts": 4, "seed": 0}
    return PartitionOptions(**{**base, **update})


def assignment(ref: PartitionRef) -> dict[int, int]:
    table = pq.read_table(ref.path / "assignment.parquet")
    return dict(zip(table.column("node_id").to_pylist(), table.column("part").to_pylist()))


def edge_cut(dataset: DatasetRef, parts: dict[int, int]) -> int:
    edges = pq.read_table(dataset.path / "edges.parquet")
    src = np.array([parts[i] for i in edges.column("src").to_pylist()])
    dst = np.array([parts[i] for i in edges.column("dst").to_pylist()])
    return int(np.count_nonzero(src != dst))


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("method", ["random", "metis", "column"])
def test_old_nodes_keep_their_part(versions: Versions, method: str):
    options = options_for(method)
    base = build_partition(versions.store, versions.v1, options)
    stable = build_partition(versions.store, versions.v2, options.model_copy(update={"stable_from": base.fp}))
    before, after = assignment(base), assignment(stable)

    assert stable.fp != build_partition(versions.store, versions.v2, options).fp
    assert set(after) == set(range(10, 10 + 7 * versions.v2.num_nodes, 7))  # every v2 node assigned
    assert all(after[node] == part for node, part in before.items())  # 100 % of v1 nodes kept
    assert set(after.values()) == set(range(options.parts))
    m = stable.manifest
    new = versions.v2.num_nodes - versions.v1.num_nodes
    assert (m.stable_from, m.kept_nodes, m.moved_nodes, m.new_nodes, m.removed_nodes) == (
        base.fp, versions.v1.num_nodes, 0, new, 0)
    sizes = np.bincount(list(after.values()), minlength=options.parts)
    if method == "random":
        assert sizes.max() - sizes.min() <= 1
    if method == "metis":
        assert sizes.max() <= math.ceil(versions.v2.num_nodes / options.parts * 1.03)


def test_metis_places_new_nodes_next_to_their_neighbours(versions: Versions):
    """Greedy neighbour majority cuts far fewer of the new edges than dealing new nodes at random."""
    options = options_for("metis")
    base = build_partition(versions.store, versions.v1, options)
    stable = build_partition(versions.store, versions.v2, options.model_copy(update={"stable_from": base.fp}))
    ids = np.array(sorted(assignment(stable)))
    carried = np.array([assignment(base).get(i, UNPLACED) for i in ids])
    dealt = dict(zip(ids.tolist(), fill_balanced(carried, 4, seed=0).tolist()))
    base_cut = edge_cut(versions.v1, assignment(base))
    assert stable.edge_cut == edge_cut(versions.v2, assignment(stable))
    assert stable.edge_cut - base_cut < 0.5 * (edge_cut(versions.v2, dealt) - base_cut)


def test_anchor_nodes_that_are_gone_are_dropped(versions: Versions):
    """Anchored the other way round (v1 from a v2 partition): the 5 % v2-only nodes are removed."""
    options = options_for("random")
    newer = build_partition(versions.store, versions.v2, options)
    older = build_partition(versions.store, versions.v1, options.model_copy(update={"stable_from": newer.fp}))
    m = older.manifest
    assert (m.kept_nodes, m.moved_nodes, m.new_nodes, m.removed_nodes) == (
        versions.v1.num_nodes, 0, 0, versions.v2.num_nodes - versions.v1.num_nodes)
    assert all(assignment(newer)[node] == part for node, part in assignment(older).items())


def test_fingerprint_prefix_resolves_to_the_same_partition(versions: Versions):
    options = options_for("random")
    base = build_partition(versions.store, versions.v1, options)
    full = build_partition(versions.store, versions.v2, options.model_copy(update={"stable_from": base.fp}))
    short = build_partition(versions.store, versions.v2, options.model_copy(update={"stable_from": base.fp[:6]}))
    assert short.fp == full.fp and not short.created


def test_unanchored_fingerprints_are_unchanged():
    assert "stable_from" not in PartitionOptions(method="metis", parts=4).fingerprint_payload()
    assert PartitionOptions(stable_from="  ").stable_from is None
    old = {"kind": "partition", "fp": "x", "format": 2, "dataset": "d", "dataset_name": "n", "method": "metis",
           "parts": 4, "edge_cut": 1, "halo_total": 1, "num_nodes": 1, "num_edges": 1, "num_features": 1,
           "num_classes": 1}
    m = PartitionManifest.model_validate(old)  # a manifest written before stable partitions
    assert (m.stable_from, m.kept_nodes, m.moved_nodes, m.new_nodes, m.removed_nodes) == (None,) * 5


# --------------------------------------------------------------------------- previous


def test_previous_resolves_to_the_newest_matching_partition_of_the_previous_version(fresh_versions: Versions):
    store, v1, v2 = fresh_versions.store, fresh_versions.v1, fresh_versions.v2
    build_partition(store, v1, options_for("metis", seed=0))
    build_partition(store, v1, options_for("random", seed=5))  # other method: not an anchor
    anchor = build_partition(store, v1, options_for("metis", seed=1))  # newest metis / 4 parts of v1
    previous = options_for("metis", stable_from="previous")

    assert resolve_stable_from(store, v2, previous).stable_from == anchor.fp
    assert find_partition(store, v2, previous) is None
    first = build_partition(store, v2, previous)
    assert first.created and first.manifest.stable_from == anchor.fp and first.manifest.moved_nodes == 0
    found = find_partition(store, v2, previous)
    again = build_partition(store, v2, previous)
    assert found is not None and found.fp == first.fp
    assert again.fp == first.fp and not again.created
    assert first.fp == partition_fingerprint(v2.fp, previous.model_copy(update={"stable_from": anchor.fp}))


def test_previous_without_an_earlier_partition_partitions_from_scratch(fresh_versions: Versions):
    store, v1, v2 = fresh_versions.store, fresh_versions.v1, fresh_versions.v2
    previous = options_for("random", stable_from="previous")
    plain = build_partition(store, v1, options_for("random"))
    on_v1 = build_partition(store, v1, previous)  # v1 has no earlier version
    on_v2 = build_partition(store, v2, options_for("random", parts=2, stable_from="previous"))  # no 2-part anchor
    assert on_v1.fp == plain.fp and not on_v1.created
    assert on_v2.manifest.stable_from is None and on_v2.manifest.kept_nodes is None
    assert on_v2.fp == build_partition(store, v2, options_for("random", parts=2)).fp


# --------------------------------------------------------------------------- errors, catalog, CLI


def test_unknown_anchor_and_parts_mismatch_are_refused(versions: Versions):
    with pytest.raises(StoreError, match="stable_from 'feedfacecafebeef': no partition"):
        build_partition(versions.store, versions.v2, options_for("metis", stable_from="feedfacecafebeef"))
    with pytest.raises(StoreError, match="stable_from 'feedfacecafebeef': no partition"):
        find_partition(versions.store, versions.v2, options_for("metis", stable_from="feedfacecafebeef"))
    base = build_partition(versions.store, versions.v1, options_for("metis"))
    with pytest.raises(StoreError, match=f"stable_from partition {base.fp} has 4 parts, but 3 were asked for"):
        build_partition(versions.store, versions.v2, options_for("metis", parts=3, stable_from=base.fp))


def test_catalog_shows_kept_moved_new(versions: Versions, tmp_path: Path):
    base = build_partition(versions.store, versions.v1, options_for("random"))
    stable = build_partition(versions.store, versions.v2, options_for("random", stable_from=base.fp))
    _, rows = query(versions.store, "SELECT stable_from, kept_nodes, moved_nodes, new_nodes FROM partitions "
                                    f"WHERE partition IN ('{base.fp}', '{stable.fp}') ORDER BY stable_from NULLS FIRST")
    assert rows == [(None, None, None, None), (base.fp, 400, 0, 20)]
    columns, rows = query(Store.open(tmp_path / "empty"), "SELECT stable_from, kept_nodes, moved_nodes, new_nodes "
                                                           "FROM partitions")
    assert columns == ["stable_from", "kept_nodes", "moved_nodes", "new_nodes"] and rows == []


def test_cli_stable_from(versions: Versions):
    base = build_partition(versions.store, versions.v1, options_for("metis"))
    expected = partition_fingerprint(versions.v2.fp, options_for("metis", stable_from=base.fp))
    result = run_cli("partition", NAME, "--method", "metis", "--parts", "4", "--stable-from", base.fp,
                     store=versions.store.root)
    assert result.returncode == 0, result.stderr
    assert f"partition {expected} (metis, 4 parts):" in flat(result.stdout)
    assert assignment(find_partition(versions.store, versions.v2, options_for("metis", stable_from=base.fp))) \
        .items() >= assignment(base).items()

    unknown = run_cli("partition", NAME, "--method", "metis", "--parts", "4", "--stable-from", "0123abcd",
                      store=versions.store.root)
    assert unknown.returncode == 2
    lines = unknown.stderr.strip().splitlines()
    assert len(lines) == 1 and "stable_from '0123abcd': no partition" in lines[0], unknown.stderr


# --------------------------------------------------------------------------- helpers


def test_balanced_quotas_fill_the_smallest_parts_first():
    assert balanced_quotas(np.array([10, 12, 30]), 5).tolist() == [4, 1, 0]  # sizes 14, 13, 30
    assert balanced_quotas(np.array([12, 10, 30]), 5).tolist() == [2, 3, 0]  # sizes 14, 13, 30
    assert balanced_quotas(np.array([5, 5, 5]), 4).tolist() == [2, 1, 1]
    assert balanced_quotas(np.array([0, 0]), 0).tolist() == [0, 0]


def test_greedy_placement_follows_neighbours_and_respects_capacity():
    # two placed nodes (part 0 and 1), a path of new nodes hanging off node 0, one isolated new node
    part = np.array([0, 1, UNPLACED, UNPLACED, UNPLACED, UNPLACED])
    src, dst = np.array([0, 2, 3, 1]), np.array([2, 3, 4, 1])
    placed = grow_from_neighbours(part, src, dst, parts=2, seed=0, slack=1.0)  # capacity 3 per part
    assert placed[:2].tolist() == [0, 1]
    assert placed[2:4].tolist() == [0, 0]  # part 0 is full after node 3
    assert np.bincount(placed, minlength=2).tolist() == [3, 3]  # 4 and 5 go to part 1
    assert (grow_from_neighbours(part, src, dst, parts=2, seed=0, slack=2.0)[2:5] == 0).all()
