"""``benchmarks/holdout_split.py`` re-splits a suite graph 60/20/20 without changing the graph: a Planetoid
graph written to an ``.npz`` ingests to the same nodes, labels, edges and features as its original files."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from processes import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from holdout_split import resplit  # noqa: E402

from graphstore.ingest.api import ingest_planetoid  # noqa: E402
from graphstore.layout import Store  # noqa: E402


def table(dataset_path: Path, name: str) -> dict[str, list]:
    return pq.read_table(dataset_path / f"{name}.parquet").to_pydict()


def test_the_resplit_graph_is_the_original_graph_with_a_stratified_60_20_20_split(tmp_path: Path):
    store = Store.open(tmp_path / "store")
    original = ingest_planetoid(store, REPO / "data" / "cora", "cora")
    drawn = resplit(store, REPO / "data", "cora", tmp_path)
    assert (drawn.num_nodes, drawn.num_edges, drawn.num_features, drawn.num_classes) == (
        original.num_nodes, original.num_edges, original.num_features, original.num_classes)

    before, after = table(original.path, "nodes"), table(drawn.path, "nodes")
    assert after["node_id"] == before["node_id"] and after["label"] == before["label"]  # Planetoid ids are 0..N-1
    edges = [table(d.path, "edges") for d in (original, drawn)]
    assert [set(zip(e["src"], e["dst"])) for e in edges] == [set(zip(edges[0]["src"], edges[0]["dst"]))] * 2
    features = [pq.read_table(d.path / "features.parquet") for d in (original, drawn)]
    assert features[1].equals(features[0])

    counts = Counter(zip(after["label"], after["split"]))
    for label in set(after["label"]):
        total = sum(n for (c, _), n in counts.items() if c == label)
        assert abs(counts[(label, "train")] - 0.6 * total) <= 1
        assert abs(counts[(label, "val")] - 0.2 * total) <= 1
    assert Counter(after["split"]) == {"train": 1626, "val": 540, "test": 542}
