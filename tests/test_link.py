"""The link task: the split, the pairs per partition, what workers see, metrics and bytes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.sparse

from conftest import run_cli
from graphstore.ingest.link_split import LinkSplitOptions, site_pairs, split_links
from graphstore.layout import LINK_PAIRS, PART_PAIRS, Store
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from graphstore.lookup import find_dataset
from graphstore.parquet_io import features_of, read_table
from graphstore.sql_query import query
from retexo_core.config import TrainConfig
from retexo_core.data import load_part
from retexo_core.link import NEGATIVE_POOL
from retexo_core.metrics import hits_at_k, mean_reciprocal_rank, roc_auc
from retexo_core.recipe import search_for
from training_helpers import F, HIDDEN, K, comm_log, halo_total, ingest_sbm, small_config, train


def query_rows(store: Store, sql: str) -> list[tuple[object, ...]]:
    return query(store, sql)[1]


def edge_keys(src: np.ndarray, dst: np.ndarray) -> set[tuple[int, int]]:
    return set(zip(src.tolist(), dst.tolist()))


@pytest.fixture(scope="module")
def link_graph(tmp_path_factory: pytest.TempPathFactory):
    """A 300-node SBM (dense features), its link split and a random partition into K parts."""
    store = Store.open(tmp_path_factory.mktemp("link-store"))
    source = ingest_sbm(store)
    dataset = split_links(store, source, "sbm_link", LinkSplitOptions(val=0.1, test=0.2, seed=4))
    partition = build_partition(store, dataset, PartitionOptions(method="random", parts=K, seed=0))
    return store, source, dataset, partition


def test_split_holds_out_edges_and_draws_negatives_once(link_graph) -> None:
    store, source, dataset, _ = link_graph
    full = read_table(source.path / "edges.parquet")
    every = edge_keys(full.column("src").to_numpy(), full.column("dst").to_numpy())
    kept = read_table(dataset.path / "edges.parquet")
    training = edge_keys(kept.column("src").to_numpy(), kept.column("dst").to_numpy())
    pairs = read_table(dataset.path / LINK_PAIRS).to_pandas()
    undirected = len([1 for u, v in every if u < v])
    for split, fraction in (("val", 0.1), ("test", 0.2)):
        mine = pairs[pairs.split == split]
        positive, negative = mine[mine.label == 1], mine[mine.label == 0]
        assert len(positive) == len(negative) == int(fraction * undirected)
        for u, v in zip(positive.src, positive.dst):
            assert (u, v) in every and (v, u) in every  # a real edge ...
            assert (u, v) not in training and (v, u) not in training  # ... held out both ways
        for u, v in zip(negative.src, negative.dst):
            assert u != v and (u, v) not in every and (v, u) not in every
    held = len(pairs[pairs.label == 1])
    assert len(training) == len(every) - 2 * held
    assert len(set(zip(pairs.src, pairs.dst))) == len(pairs)  # every pair once
    assert dataset.name == "sbm_link" and dataset.manifest.link_pairs == {
        "train_positive": undirected - held, "val_positive": int(0.1 * undirected), "val_negative": int(0.1 * undirected),
        "test_positive": int(0.2 * undirected), "test_negative": int(0.2 * undirected)}
    again = split_links(store, source, "sbm_link", LinkSplitOptions(val=0.1, test=0.2, seed=4))
    assert again.fp == dataset.fp and not again.created


def test_pairs_go_to_the_target_owner_and_no_held_out_edge_reaches_a_worker(link_graph) -> None:
    _, _, dataset, partition = link_graph
    pairs = read_table(dataset.path / LINK_PAIRS).to_pandas()
    held = edge_keys(pairs.src[pairs.label == 1].to_numpy(), pairs.dst[pairs.label == 1].to_numpy())
    assignment = dict(zip(*(pq.read_table(partition.path / "assignment.parquet").column(c).to_numpy()
                            for c in ("node_id", "part"))))
    seen = 0
    for part in range(K):
        data = load_part(partition.path, part)  # what the worker of this part holds
        ids = np.concatenate([data.node_id, data.halo_id])
        adjacency = edge_keys(ids[data.src], data.node_id[data.dst])
        assert not adjacency & held and not adjacency & {(v, u) for u, v in held}
        mine = read_table(partition.path / f"part={part}" / PART_PAIRS).to_pandas()
        assert all(assignment[d] == part for d in mine.dst)
        assert all(assignment[s] == o for s, o in zip(mine.src, mine.src_owner))
        assert data.pairs is not None and len(data.pairs.src_id) == len(mine)
        seen += len(mine)
    assert seen == len(pairs)


def test_retexo_link_metrics_equal_one_process_and_link_rows_bytes_are_exact(link_graph) -> None:
    store, _, dataset, partition = link_graph
    config = small_config(task="link", link_dim=4, rounds=[4, 3], normalize_features="none", recommend=3)
    plan = train(store, dataset, partition, config)
    check_recommendations(store, dataset, plan.run_fp, 3)
    scores = query_rows(store, f"SELECT split, label, score FROM link_scores WHERE run = '{plan.run_fp}'")
    evaluation = {r[0]: r for r in query_rows(store, "SELECT split, roc_auc, mrr, hits_at_k, pairs FROM "
                                                     f"run_evaluation WHERE run = '{plan.run_fp}'")}
    pairs = read_table(dataset.path / LINK_PAIRS)
    assert len(scores) == pairs.num_rows
    for split in ("val", "test"):
        mine = np.array([(label, score) for s, label, score in scores if s == split])
        pos, neg = mine[mine[:, 0] == 1, 1], mine[mine[:, 0] == 0, 1]
        _, auc, mrr, hits, count = evaluation[split]
        assert count == len(mine)
        assert auc == pytest.approx(roc_auc(mine[:, 1], mine[:, 0].astype(np.int64)), abs=1e-6)
        assert mrr == pytest.approx(mean_reciprocal_rank(pos, neg), abs=1e-6)
        assert hits == pytest.approx(hits_at_k(pos, neg, config.hits_k), abs=1e-6)
    # link_rows: per layer, every rank sends each peer the aggregated rows of the nodes that peer
    # needs (its halo sources and its pairs' remote sources), float32, width F then HIDDEN
    assert comm_log(plan)["link_rows"] == needed_rows(partition) * 4 * (F + HIDDEN)


def check_recommendations(store: Store, dataset, run: str, k: int) -> None:  # noqa: ANN001
    """k candidates per node, ranked 1..k by score, never the node itself or a training edge."""
    rows = query_rows(store, f"SELECT node_id, candidate, score, rank FROM recommendations WHERE run = '{run}' "
                             "ORDER BY node_id, rank")
    nodes = read_table(dataset.path / "nodes.parquet").column("node_id").to_numpy()
    assert len(rows) == k * len(nodes) and {r[0] for r in rows} == set(nodes.tolist())
    edges = read_table(dataset.path / "edges.parquet")
    training = edge_keys(edges.column("src").to_numpy(), edges.column("dst").to_numpy())
    for node in range(0, len(rows), k):
        mine = rows[node:node + k]
        assert [r[3] for r in mine] == list(range(1, k + 1))
        assert [r[2] for r in mine] == sorted((r[2] for r in mine), reverse=True)
        for node_id, candidate, _, _ in mine:
            assert candidate != node_id and (candidate, node_id) not in training and (node_id, candidate) not in training


def needed_rows(partition) -> int:  # noqa: ANN001
    """Rows all ranks together receive to score their pairs, positives and negatives: per rank,
    the union of its halo and its pairs' remote sources, and every peer's negative pool (the
    peer's part, or NEGATIVE_POOL of its nodes)."""
    total = 0
    sizes = [load_part(partition.path, part).num_owned for part in range(K)]
    for part in range(K):
        data = load_part(partition.path, part)
        assert data.pairs is not None
        total += len(np.union1d(data.halo_id, data.pairs.src_id[data.pairs.src_owner != part]))
        total += sum(min(size, NEGATIVE_POOL) for peer, size in enumerate(sizes) if peer != part)
    return total


def test_standard_link_sends_the_last_embeddings_every_epoch(link_graph) -> None:
    store, _, dataset, partition = link_graph
    epochs, width = 3, 4
    plan = train(store, dataset, partition, small_config(task="link", link_dim=width, strategy="standard",
                                                         epochs=epochs, normalize_features="none"))
    # every forward (training, validation each epoch, the final scoring) sends the hidden halo rows
    # and the last layer's rows of the remote nodes; every backward sends their gradients back
    per_forward = 4 * (halo_total(partition) * HIDDEN + needed_rows(partition) * width)
    sent = comm_log(plan)
    assert sent["halo_embeddings"] == (2 * epochs + 1) * per_forward
    assert sent["halo_grads"] == epochs * per_forward
    rows = query_rows(store, f"SELECT count(*) FROM link_scores WHERE run = '{plan.run_fp}'")
    assert rows[0][0] == read_table(dataset.path / LINK_PAIRS).num_rows


def test_tma_link_trains_apart_and_is_scored_on_every_pair(link_graph) -> None:
    store, _, dataset, partition = link_graph
    plan = train(store, dataset, partition, small_config(task="link", link_dim=4, strategy="tma", epochs=4,
                                                         agg_every_steps=2))
    log = pq.read_table(store.run_dir(plan.run_fp) / "comm.parquet").to_pandas()
    training = log[log.epoch >= 0]
    assert set(training.kind) == {"model_sync", "control"}  # apart: no row crosses while training
    assert set(log[log.epoch < 0].kind) >= {"halo_embeddings"}  # the final scoring needs the remote rows
    rows = query_rows(store, f"SELECT count(*) FROM link_scores WHERE run = '{plan.run_fp}'")
    assert rows[0][0] == read_table(dataset.path / LINK_PAIRS).num_rows


def test_centralized_link_run_and_refusals(link_graph, tmp_path) -> None:
    store, source, dataset, _ = link_graph
    plan = train(store, dataset, None, small_config(task="link", link_dim=4, strategy="centralized", epochs=4,
                                                    recommend=2))
    check_recommendations(store, dataset, plan.run_fp, 2)
    rows = query_rows(store, f"SELECT split, roc_auc, pairs FROM run_evaluation WHERE run = '{plan.run_fp}' ORDER BY split")
    assert [r[0] for r in rows] == ["test", "val"] and all(0 <= r[1] <= 1 and r[2] > 0 for r in rows)
    assert "link_rows" not in comm_log(plan)  # one process: nothing to exchange
    for args, expected in (
        (["train", source.name, "--task", "link"], "has no held-out edges"),
        (["train", dataset.name], "is a link split"),
        (["train", dataset.name, "--task", "link", "--model", "gat"], "layer-wise GAT is not supported"),
        (["train", dataset.name, "--task", "link", "--strategy", "grappa"], "task link is trained by retexo, centralized"),
    ):
        result = run_cli(*args, store=store.root)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_featureless_bipartite_table_gets_identity_features_and_trains_links(tmp_path) -> None:
    """Users x items without labels or features: ``--missing-features identity`` gives node i the
    one-hot feature i (sparse), the default keeps the constant feature and its fingerprint."""
    rng = np.random.default_rng(0)
    users, items = np.arange(40), np.arange(100, 130)
    edges = {(int(u), int(i)) for u in users for i in rng.choice(items, 4, replace=False)}
    (tmp_path / "edges.csv").write_text("src,dst\n" + "".join(f"{u},{i}\n" for u, i in sorted(edges)))
    (tmp_path / "nodes.csv").write_text("node_id,label\n" + "".join(f"{n},-1\n" for n in [*users, *items]))
    store = tmp_path / "store"
    common = ["ingest", "tables", "--edges", tmp_path / "edges.csv", "--nodes", tmp_path / "nodes.csv", "--undirected"]
    for name, extra in (("shop", []), ("shop_id", ["--missing-features", "identity"])):
        result = run_cli(*common, "--name", name, *extra, store=store)
        assert result.returncode == 0, result.stderr
    ref = {name: find_dataset(Store.open(store), name) for name in ("shop", "shop_id")}
    assert ref["shop"].num_features == 1 and ref["shop_id"].num_features == 70
    assert ref["shop_id"].manifest.feature_format == "sparse"
    x = features_of(read_table(ref["shop_id"].path / "features.parquet"), 70)
    assert (x != scipy.sparse.identity(70, format="csr")).nnz == 0
    # features on one side: users have a row, items none
    (tmp_path / "features.csv").write_text("node_id,f0,f1\n" + "".join(f"{u},{u % 2},1.0\n" for u in users))
    refused = run_cli(*common, "--features", tmp_path / "features.csv", "--name", "shop_users", store=store)
    assert refused.returncode == 2 and "no feature row for node 100" in refused.stderr, refused.stderr
    result = run_cli(*common, "--features", tmp_path / "features.csv", "--name", "shop_users",
                     "--missing-features", "zero", store=store)
    assert result.returncode == 0, result.stderr
    users_only = find_dataset(Store.open(store), "shop_users")
    x = features_of(read_table(users_only.path / "features.parquet"), 2)
    assert np.array_equal(x[:40], np.stack([users % 2, np.ones(40)], axis=1)) and not x[40:].any()
    for args in (["ingest", "link-split", "shop_id", "--name", "shop_link"],
                 ["train", "shop_link", "--task", "link", "--parts", "2", "--rounds", "3", "--recipe", "default"]):
        result = run_cli(*args, store=store, timeout=300)
        assert result.returncode == 0, result.stderr


def test_the_link_search_screens_20_rounds_and_keeps_layer_1_without_a_root_weight() -> None:
    """Layer-wise link training searches no skip on layer 1 (it would double the widest gradient
    sync) and screens each candidate 20 rounds; layer 2 and every end-to-end strategy search skip
    (``--recipe default``: the features alone)."""
    def knobs(config: TrainConfig, layer: int, end_to_end: bool = False) -> set[str]:
        return {name for name, _ in search_for(config, layer, end_to_end=end_to_end, nonnegative=True).plan}

    link, node = TrainConfig(task="link"), TrainConfig()
    assert "skip" not in knobs(link, 1) and "skip" in knobs(link, 2) and "skip" in knobs(node, 1)
    for strategy in ("centralized", "standard", "tma"):  # every end-to-end strategy searches every knob
        searched = knobs(TrainConfig(task="link", strategy=strategy), 1, end_to_end=True)
        assert searched == {"features", "skip", "norm", "decay", "dropout", "lr"}, strategy
    assert knobs(TrainConfig(task="link", strategy="standard", recipe="default"), 1, end_to_end=True) == {"features"}
    assert (link.screen_rounds, node.screen_rounds, TrainConfig(task="link", recipe_screen=7).screen_rounds) == (20, 50, 7)


def test_a_split_file_names_the_held_out_edges(link_graph, tmp_path) -> None:
    """``--split-edges FILE`` (src, dst, split): its val and test rows are held out in both
    directions, every other edge trains; bad rows are one line naming the file, column and row."""
    store, source, _, _ = link_graph
    edges = read_table(source.path / "edges.parquet")
    src, dst = edges.column("src").to_numpy(), edges.column("dst").to_numpy()
    forward = np.flatnonzero(src < dst)
    split = np.array(["train"] * len(forward), dtype=object)
    split[:30], split[30:40] = "test", "val"
    table = tmp_path / "edges_split.csv"
    table.write_text("src,dst,split\n" + "".join(f"{dst[i]},{src[i]},{s}\n" for i, s in zip(forward, split)))
    dataset = split_links(store, source, "sbm_by_file", LinkSplitOptions(split_edges=str(table), seed=1))
    pairs = read_table(dataset.path / LINK_PAIRS)
    for name, rows in (("test", forward[:30]), ("val", forward[30:40])):
        chosen = pairs.filter(pairs.column("split").to_numpy(zero_copy_only=False) == name)
        positives = chosen.filter(chosen.column("label").to_numpy() == 1)
        assert edge_keys(positives.column("src").to_numpy(), positives.column("dst").to_numpy()) == \
            edge_keys(src[rows], dst[rows])
        assert chosen.num_rows == 2 * len(rows)
    kept = read_table(dataset.path / "edges.parquet")
    held = edge_keys(src[forward[:40]], dst[forward[:40]]) | edge_keys(dst[forward[:40]], src[forward[:40]])
    assert edge_keys(kept.column("src").to_numpy(), kept.column("dst").to_numpy()) == edge_keys(src, dst) - held
    # a site (its nodes and the edges into them) holds out the listed edges it has, in either direction
    node_id = read_table(source.path / "nodes.parquet").column("node_id").to_numpy()
    mine = np.isin(dst, node_id[:150])
    _, keep = site_pairs(node_id[:150], src[mine], dst[mine], LinkSplitOptions(split_edges=str(table), seed=1),
                            np.random.default_rng(1))
    assert edge_keys(src[mine][~keep], dst[mine][~keep]) == held & edge_keys(src[mine], dst[mine])
    (tmp_path / "bad_value.csv").write_text(f"src,dst,split\n{src[0]},{dst[0]},holdout\n")
    (tmp_path / "no_edge.csv").write_text(f"src,dst,split\n{src[0]},{dst[0]},test\n{src[0]},{src[0]},test\n")
    for file, expected in (("bad_value.csv", "column 'split', row 1: expected train, val or test, found 'holdout'"),
                           ("no_edge.csv", f"column 'src', row 2: {src[0]} -> {src[0]} is not an edge of the graph")):
        result = run_cli("ingest", "link-split", source.name, "--name", "bad_split", "--split-edges",
                         tmp_path / file, store=store.root)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
