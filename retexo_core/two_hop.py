"""The halo's own in-edges and the rows they read: what a rank needs to compute a GAT layer at its
halo nodes as their owners do (the last two GAT layers trained together, ``strategies/joint.py``).

A GAT layer's output at node u reads u's in-neighbours' inputs through attention weights that
depend on the parameters, so u's owner cannot send one aggregate that serves every round, as it
does for GCN and SAGE. It can send u's in-edges once, and the inputs of the sources the receiver
does not hold. One exchange in three steps, at layer L, round -1:

1. every owner sends, for each node a peer holds as halo (in that peer's halo order), its number
   of in-edges (self loops excluded) and their sources' node ids (``control``: 8 B each, as the
   halo plan's ids);
2. each rank asks, for every source it holds neither as owned nor as halo row, one peer that named
   it (the lowest rank), for its row (``control``: 8 B per id);
3. that peer sends the rows, which it holds as owned or as halo rows of the layer's inputs
   (``two_hop_rows``, compressed as the halo rows are).

The result is the local inputs extended by those rows and the graph whose targets are the owned
and the halo nodes, over the owned, halo and two-hop sources, one self loop each (as
``models.local_graph`` builds GAT's graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from retexo_core.comm.communicator import Communicator
from retexo_core.data import PartData
from retexo_core.exchange import ExchangePlan, exchange_rows, stack_rows
from retexo_core.models import Features, LocalGraph, local_graph

KIND = "two_hop_rows"


@dataclass
class TwoHop:
    """x: (n + h + k, d) the owned rows, the halo's, then the k two-hop sources' rows;
    graph: (n + h, n + h + k) GAT's local graph of the owned and halo targets."""

    x: Features
    graph: LocalGraph


def in_edges(data: PartData) -> tuple[np.ndarray, np.ndarray]:
    """The owned nodes' in-edges without self loops, grouped by target: (n + 1,) offsets into the
    (E',) global ids of their sources."""
    keep = data.src != data.dst
    src, dst = data.src[keep], data.dst[keep]
    order = np.argsort(dst, kind="stable")
    ids = np.concatenate([data.node_id, data.halo_id])
    offsets = np.searchsorted(dst[order], np.arange(data.num_owned + 1))
    return offsets, ids[src[order]]


def positions(ids: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Positions in ``ids`` (distinct) of every entry of ``query``; -1 where absent."""
    order = np.argsort(ids, kind="stable")
    at = np.searchsorted(ids, query, sorter=order)
    at = np.minimum(at, len(ids) - 1) if len(ids) else np.zeros_like(query)
    found = (ids[order[at]] == query) if len(ids) else np.zeros(len(query), bool)
    return np.where(found, order[at], -1)


def two_hop(comm: Communicator, data: PartData, plan: ExchangePlan, local: Features, model_device: torch.device
            ) -> TwoHop:
    """The exchange of the module docstring, for the (n + h, d) local inputs ``local`` (owned rows,
    then the halo's in ``plan``'s order)."""
    world, me, n = comm.world, comm.rank, data.num_owned
    offsets, sources = in_edges(data)
    counts = offsets[1:] - offsets[:-1]
    # 1. the in-edges of the nodes each peer holds as halo
    sent_counts = [torch.from_numpy(counts[idx]) for idx in plan.send_index]
    got_counts = comm.exchange(sent_counts, [(len(idx),) for idx in plan.recv_index], torch.int64, "control")
    sent_ids = [torch.from_numpy(np.concatenate([sources[offsets[p]:offsets[p + 1]] for p in idx])
                                 if len(idx) else np.empty(0, np.int64)) for idx in plan.send_index]
    got_ids = comm.exchange_variable(sent_ids, "control")
    local_ids = np.concatenate([data.node_id, data.halo_id])
    halo_dst, halo_src, named_by = [], [], []
    for j, idx in enumerate(plan.recv_index):
        if j == me or not len(idx):
            continue
        c = got_counts[j].numpy()
        halo_dst.append(np.repeat(n + idx, c))
        halo_src.append(got_ids[j].numpy())
        named_by.append(np.full(int(c.sum()), j))
    halo_dst_a = np.concatenate(halo_dst) if halo_dst else np.empty(0, np.int64)
    halo_src_a = np.concatenate(halo_src) if halo_src else np.empty(0, np.int64)
    named_a = np.concatenate(named_by) if named_by else np.empty(0, np.int64)
    # 2. the sources held nowhere here, each asked of the lowest rank that named it
    missing = positions(local_ids, halo_src_a) < 0
    far, first = np.unique(halo_src_a[missing], return_index=True)
    asker = named_a[missing][first]
    asked = comm.exchange_variable([torch.from_numpy(far[asker == j]) for j in range(world)], "control")
    # 3. their rows, from the local inputs of the peer asked
    send_index = [positions(local_ids, asked[j].numpy()) if j != me else np.empty(0, np.int64) for j in range(world)]
    if any((s < 0).any() for s in send_index):
        raise RuntimeError(f"rank {me}: a peer asked for rows of nodes this rank does not hold")
    recv_index = [np.flatnonzero(asker == j) for j in range(world)]
    rows = exchange_rows(comm, ExchangePlan(send_index, recv_index, len(far)), local, KIND)
    x = stack_rows(local, rows)
    all_ids = np.concatenate([local_ids, far])
    src = np.concatenate([data.src, positions(all_ids, halo_src_a)])
    dst = np.concatenate([data.dst, halo_dst_a])
    graph = local_graph("gat", src, dst, torch.zeros(0), n + len(data.halo_id), len(all_ids))
    return TwoHop(x, graph.to(model_device))
