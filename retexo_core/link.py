"""Link prediction on partitions: which rows a rank embeds, the link objective, and its metrics.

A rank scores a pair (u, v) where v is owned, as it aggregates the edges into v: by the dot
product of the two nodes' embeddings. It embeds its owned nodes and the *remote rows* it needs:
the halo sources of its training edges and the remote sources of its evaluation pairs. A
layer's embedding of a node is ``block(aggregated inputs)`` (GCN's Â·X row, SAGE's neighbour mean
and own row), and the aggregated inputs of a layer are frozen in layer-wise training, so each
layer sends every peer the aggregated rows of its nodes that peer needs once (kind
``link_rows``), after the layer's halo exchange; every round then embeds the remote rows with the
current parameters, exactly as their owner would. Nothing else moves per round but the
gradient sum and validation counts.

Training positives are the stored (training) edges into owned nodes, self loops excluded; each
round draws as many negatives from the rank's own stream: a random owned target and a source
drawn uniformly from the *whole graph*, as a centralized sampler draws it. A rank cannot embed
every node, so each peer also sends it, with the same ``link_rows`` exchange, the aggregated rows
of a random sample of up to ``NEGATIVE_POOL`` of its nodes (the *negative pool*, drawn once per
launch); a source from peer j's part (probability n_j / N) is a uniform row of that pool, and a
whole part when it is smaller than the pool. Sampling negatives only among the rows a rank
happens to hold would draw them from its own part, nodes close to the target (METIS), which are
harder than the uniform pairs a test split holds. The loss is binary cross-entropy on the scores
(logits), summed and divided by twice the global number of positives, so that summed gradients
are those of the mean.

Model selection uses the validation ROC-AUC from a histogram of the scores (``SCORE_BINS`` bins
of the logits clipped to ±``SCORE_CLIP``; one all-reduce of counts, control); the final metrics
are exact: every rank sends rank 0 its pairs' scores, labels and splits (no node id), and rank 0
computes ROC-AUC, MRR and Hits@K per split (``retexo_core.metrics``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from retexo_core.comm.communicator import Communicator
from retexo_core.data import PAIR_SPLITS, LinkPairs, PartData, local_positions
from retexo_core.exchange import ExchangePlan
from retexo_core.metrics import histogram_auc, hits_at_k, mean_reciprocal_rank, roc_auc, score_histogram

NEGATIVE_POOL = 4096  # rows each peer sends every rank for its negative sources (a part's nodes when fewer)
SCORE_CLIP = 16.0  # validation histogram: logits clipped to +-16
SCORE_BINS = 1024  # bins of 1/32


@dataclass
class LinkIndex:
    """The rows one rank embeds and the pairs it scores (positions into those rows).

    Rows: the n owned nodes, then the r remote rows this rank scores with, grouped by owner
    (sorted by id within an owner), then the negative pools of the peers (in rank order).
    plan: the ``link_rows`` exchange (owned rows each peer needs, then the pool sent to it; where
        received rows land).
    row_id: the node id of every row, in row order (a pool's ids come with it, 8 B each, control),
        except at sites, where no id leaves its site beyond discovery: there only the owned and
        remote rows have ids (the pools' rows, last, none).
    train_src, train_dst: (t,) int64 positives: training edges into owned nodes, no self loops.
    pair_rows: (p,) int64 positions in ``PartData.pairs`` of the pairs scored (every pair; in
        isolated training, the pairs whose source is owned).
    pair_src, pair_dst: (p,) int64 the rows of those pairs' sources and targets.
    negative_weight: (rows,) float64 how likely each row is drawn as a negative source: 1 for an
        owned row, n_j / (pool size) for a row of peer j's pool, 0 for the other remote rows.
    positives: training positives over all ranks.
    """

    plan: ExchangePlan
    row_id: np.ndarray
    train_src: torch.Tensor
    train_dst: torch.Tensor
    pair_rows: np.ndarray
    pair_src: torch.Tensor
    pair_dst: torch.Tensor
    negative_weight: torch.Tensor
    positives: int

    def to(self, device: torch.device) -> "LinkIndex":
        return LinkIndex(self.plan, self.row_id, self.train_src.to(device), self.train_dst.to(device),
                         self.pair_rows, self.pair_src.to(device), self.pair_dst.to(device), self.negative_weight.to(device),
                         self.positives)


def link_index(comm: Communicator, data: PartData, seed: int) -> LinkIndex:
    """Agree with the peers on the remote rows (each rank asks each owner for its ids once, 8 B
    per id, and tells every peer its number of nodes, 8 B; control), draw the negative pool each
    peer gets (``seed``), and index this rank's positives and pairs."""
    assert data.pairs is not None
    pairs, n = data.pairs, data.num_owned
    remote = pairs.src_owner != data.part
    ids = np.concatenate([data.halo_id, pairs.src_id[remote]])
    owners = np.concatenate([data.halo_owner, pairs.src_owner[remote]])
    ids, first = np.unique(ids, return_index=True)
    owners = owners[first]
    order = np.lexsort((ids, owners))
    remote_id, remote_owner = ids[order], owners[order]
    bounds = np.searchsorted(remote_owner, np.arange(data.num_parts + 1))
    asked = comm.exchange_variable([torch.from_numpy(remote_id[bounds[j]:bounds[j + 1]]) for j in range(comm.world)],
                                   "control")
    send_index = []
    for j in range(comm.world):
        wanted = asked[j].numpy() if j != comm.rank else np.empty(0, np.int64)
        pos = np.searchsorted(data.node_id, wanted)
        if len(wanted) and (pos.max() >= n or not np.array_equal(data.node_id[pos], wanted)):
            raise RuntimeError(f"rank {comm.rank}: rank {j} asked for link rows of nodes this partition does not own")
        send_index.append(pos.astype(np.int64))
    sizes = comm.exchange_counts([n] * comm.world)
    sizes[comm.rank] = n
    pools = [min(sizes[j], NEGATIVE_POOL) if j != comm.rank else 0 for j in range(comm.world)]
    rng = np.random.default_rng([seed, comm.rank])
    pool_sent = [np.sort(rng.choice(n, min(n, NEGATIVE_POOL), replace=False)) if j != comm.rank else np.empty(0, np.int64)
                 for j in range(comm.world)]
    pool_id = [] if data.held_by_site else comm.exchange_variable([torch.from_numpy(data.node_id[p])
                                                                      for p in pool_sent], "control")
    send_index = [np.concatenate([sent, pool]) for sent, pool in zip(send_index, pool_sent)]
    starts = len(remote_id) + np.concatenate([[0], np.cumsum(pools)])
    recv_index = [np.concatenate([np.arange(bounds[j], bounds[j + 1]), np.arange(starts[j], starts[j + 1])])
                  for j in range(comm.world)]
    plan = ExchangePlan(send_index, recv_index, int(starts[-1]))
    weight = np.zeros(n + plan.num_halo)
    weight[:n] = 1.0
    for j in range(comm.world):
        weight[n + starts[j]:n + starts[j + 1]] = sizes[j] / max(pools[j], 1)
    src_id = np.concatenate([data.node_id, data.halo_id])[data.src]
    keep = src_id != data.node_id[data.dst]
    train_src = local_positions(data.node_id, remote_id, src_id[keep])
    positives = comm.all_reduce(torch.tensor([float(np.count_nonzero(keep))], dtype=torch.float64), "control")
    row_id = np.concatenate([data.node_id, remote_id, *(pool_id[j].numpy() for j in range(len(pool_id)) if j != comm.rank)])
    return LinkIndex(plan, row_id, torch.from_numpy(train_src), torch.from_numpy(data.dst[keep].astype(np.int64)),
                     np.arange(len(pairs.src_id)), torch.from_numpy(local_positions(data.node_id, remote_id, pairs.src_id)),
                     torch.from_numpy(pairs.dst.astype(np.int64)), torch.from_numpy(weight), int(positives[0]))


def isolated_link_index(data: PartData) -> LinkIndex:
    """The rows of a part that trains alone (``tma``): its own nodes only, its own edges as
    positives, negatives from its own nodes, its pairs with an owned source; nothing exchanged."""
    assert data.pairs is not None
    n, pairs = data.num_owned, data.pairs
    keep = (data.src < n) & (data.src != data.dst)
    rows = np.flatnonzero(pairs.src_owner == data.part)
    none = ExchangePlan([np.empty(0, np.int64)] * data.num_parts, [np.empty(0, np.int64)] * data.num_parts, 0)
    return LinkIndex(none, data.node_id, torch.from_numpy(data.src[keep].astype(np.int64)),
                     torch.from_numpy(data.dst[keep].astype(np.int64)), rows,
                     torch.from_numpy(np.searchsorted(data.node_id, pairs.src_id[rows])),
                     torch.from_numpy(pairs.dst[rows].astype(np.int64)), torch.ones(n, dtype=torch.float64),
                     int(np.count_nonzero(keep)))


def pair_scores(emb: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """(p,) dot products of rows ``src`` and ``dst`` of the (rows, d) embeddings (logits)."""
    return (emb[src] * emb[dst]).sum(dim=-1)


def link_loss(emb: torch.Tensor, index: LinkIndex, num_owned: int, gen: torch.Generator) -> torch.Tensor:
    """Binary cross-entropy of this rank's positives and as many fresh negatives (a source
    uniform over the graph: ``negative_weight``; a random owned target; drawn from ``gen``),
    summed and divided by 2 x the global positives."""
    count = len(index.train_src)
    if not count:
        return emb.sum() * 0.0  # no positive here: this rank adds nothing (and still takes part in the sync)
    weight = index.negative_weight.to(gen.device)
    neg_src = torch.multinomial(weight, count, replacement=True, generator=gen).to(emb.device)
    neg_dst = torch.randint(0, num_owned, (count,), generator=gen, device=gen.device).to(emb.device)
    pos = pair_scores(emb, index.train_src, index.train_dst)
    neg = pair_scores(emb, neg_src, neg_dst)
    return (F.softplus(-pos).sum() + F.softplus(neg).sum()) / max(2 * index.positives, 1)


def validation_stats(comm: Communicator, emb: torch.Tensor, index: LinkIndex, pairs: LinkPairs) -> tuple[float, float]:
    """(mean BCE loss, ROC-AUC) of the validation pairs over all ranks, from one all-reduce of
    2 + 2 x SCORE_BINS numbers (control)."""
    mask = torch.from_numpy(pairs.split[index.pair_rows] == "val").to(emb.device)
    scores = pair_scores(emb, index.pair_src[mask], index.pair_dst[mask])
    labels = pairs.label[index.pair_rows].to(emb.device)[mask]
    loss = F.binary_cross_entropy_with_logits(scores, labels, reduction="sum")
    sent = torch.cat([torch.stack([loss.double(), torch.tensor(float(len(labels)), dtype=torch.float64,
                                                                  device=emb.device)]),
                      score_histogram(scores, labels.long(), SCORE_BINS, SCORE_CLIP).flatten()]).cpu()
    total = comm.all_reduce(sent, "control").numpy()
    if not total[1]:
        return float("nan"), float("nan")
    return float(total[0] / total[1]), histogram_auc(total[2:].reshape(2, SCORE_BINS))


def link_evaluation(comm: Communicator, scores: torch.Tensor, label: torch.Tensor, split: np.ndarray,
                    hits_k: int, held_by_site: bool = False) -> list[dict[str, object]]:
    """Exact ROC-AUC, MRR and Hits@K per split of every rank's pairs: each rank sends rank 0 its
    (score, label, split) triples (24 B per pair, control; no node id). Rows of
    ``run_evaluation`` (rank 0's are the real ones; the others' metrics are NaN). Sites send no
    score: ``site_link_evaluation``."""
    if held_by_site:
        return site_link_evaluation(comm, scores, label, split, hits_k)
    code = torch.zeros(len(split), dtype=torch.float64)
    for k, name in enumerate(PAIR_SPLITS):
        code[torch.from_numpy(split == name)] = k
    local = torch.stack([scores.detach().cpu().double(), label.cpu().double(), code], dim=1)
    got = comm.exchange_variable([local if j == 0 else local[:0] for j in range(comm.world)], "control")
    everything = torch.cat([local] + [got[j] for j in range(1, comm.world)]).numpy() if comm.rank == 0 else None
    rows: list[dict[str, object]] = []
    for k, name in enumerate(PAIR_SPLITS):
        metrics = {"roc_auc": math.nan, "mrr": math.nan, "hits_at_k": math.nan}
        count = 0
        if everything is not None:
            mine = everything[everything[:, 2] == k]
            pos, neg = mine[mine[:, 1] == 1, 0], mine[mine[:, 1] == 0, 0]
            count = len(mine)
            metrics = {"roc_auc": roc_auc(mine[:, 0], mine[:, 1].astype(np.int64)),
                       "mrr": mean_reciprocal_rank(pos, neg), "hits_at_k": hits_at_k(pos, neg, hits_k)}
        rows.append({"split": name, "accuracy": math.nan, "macro_f1": math.nan, **metrics, "k": hits_k,
                     "pairs": count, "nodes": 0})
    return rows


SITE_BINS = 1 << 16  # the sites' final histograms: logits clipped to +-16 in bins of 1/2048


def site_link_evaluation(comm: Communicator, scores: torch.Tensor, label: torch.Tensor, split: np.ndarray,
                         hits_k: int) -> list[dict[str, object]]:
    """``link_evaluation`` from counts only, for sites (no score leaves a site): one all-reduce of
    every split's histograms of negative and positive logits (``SITE_BINS`` bins, control) gives
    ROC-AUC and the K-th highest negative's bin; a second of each split's sum of 1 / rank (a
    positive's rank among the negatives, those in its own bin counting half) and hits (positives
    in a bin above the K-th negative's) gives MRR and Hits@K. Exact up to the bin width."""
    scores, label = scores.detach().cpu().double(), label.cpu()
    bins = ((scores.clamp(-SCORE_CLIP, SCORE_CLIP) + SCORE_CLIP) * (SITE_BINS / (2 * SCORE_CLIP))).long()
    bins = bins.clamp(max=SITE_BINS - 1)  # each positive's bin, for its rank below
    masks = [torch.from_numpy(split == name) for name in PAIR_SPLITS]
    histograms = torch.stack([score_histogram(scores[m], label[m], SITE_BINS, SCORE_CLIP) for m in masks])
    total = comm.all_reduce(histograms, "control").numpy()  # (splits, 2, bins)
    sums = []
    for k, mask in enumerate(masks):
        negatives = total[k, 0]
        above = np.concatenate([np.cumsum(negatives[::-1])[::-1][1:], [0.0]])  # negatives in higher bins
        kth = np.flatnonzero(np.cumsum(negatives[::-1]) >= hits_k)
        kth_bin = SITE_BINS - 1 - kth[0] if len(kth) else -1
        mine = bins[mask & (label == 1)].numpy()
        rank = 1.0 + above[mine] + negatives[mine] / 2
        sums += [float((1.0 / rank).sum()), float(np.count_nonzero(mine > kth_bin))]
    summed = comm.all_reduce(torch.tensor(sums, dtype=torch.float64), "control").numpy()
    rows: list[dict[str, object]] = []
    for k, name in enumerate(PAIR_SPLITS):
        positives, pairs = total[k, 1].sum(), int(total[k].sum())
        rows.append({"split": name, "accuracy": math.nan, "macro_f1": math.nan,
                     "roc_auc": histogram_auc(total[k]), "mrr": summed[2 * k] / positives if positives else math.nan,
                     "hits_at_k": summed[2 * k + 1] / positives if positives else math.nan, "k": hits_k,
                     "pairs": pairs, "nodes": 0})
    return rows


RECOMMEND_CHUNK = 1024  # owned rows scored at once: (chunk, candidates) scores in memory


def recommendations(emb: torch.Tensor, index: LinkIndex, data: PartData, k: int) -> dict[str, np.ndarray]:
    """Each owned node's ``k`` best candidates among the nodes this rank embeds (every row with a
    distinct id: its own part, the remote rows it scores with, its peers' negative pools), by score,
    never the node itself nor a node with a training edge into it (every edge of an undirected
    graph). Returns ``node_id, candidate`` (int64), ``score`` (float32 logits) and ``rank``
    (int32, 1 = best) columns of n x min(k, candidates) rows."""
    ids, first = np.unique(index.row_id, return_index=True)  # the rows with an id (not a site's pools)
    rows = torch.from_numpy(first).to(emb.device)
    candidates = emb[rows]
    n = data.num_owned
    src_id = index.row_id[index.train_src.cpu().numpy()]
    taken_dst = index.train_dst.cpu().numpy()
    taken_col = np.searchsorted(ids, src_id)
    own_col = np.searchsorted(ids, data.node_id)
    k = min(k, len(ids) - 1)
    out: dict[str, list[np.ndarray]] = {"node_id": [], "candidate": [], "score": [], "rank": []}
    for start in range(0, n, RECOMMEND_CHUNK):
        stop = min(start + RECOMMEND_CHUNK, n)
        scores = emb[start:stop] @ candidates.T
        mine = (taken_dst >= start) & (taken_dst < stop)
        excluded = (np.concatenate([taken_dst[mine] - start, np.arange(stop - start)]),
                    np.concatenate([taken_col[mine], own_col[start:stop]]))
        scores[tuple(torch.from_numpy(e).to(emb.device) for e in excluded)] = float("-inf")
        best, where = (t.cpu().numpy() for t in scores.topk(k, dim=1))
        kept = np.isfinite(best)  # fewer than k candidates left after the exclusions
        out["node_id"].append(np.repeat(data.node_id[start:stop], k).reshape(-1, k)[kept])
        out["candidate"].append(ids[where][kept])
        out["score"].append(best.astype(np.float32)[kept])
        out["rank"].append(np.tile(np.arange(1, k + 1, dtype=np.int32), (stop - start, 1))[kept])
    return {name: np.concatenate(parts) if parts else np.empty(0) for name, parts in out.items()}
