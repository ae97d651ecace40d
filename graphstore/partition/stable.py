"""Stable partitions: nodes of an anchor partition keep their part, new nodes are placed around them.

The anchor is an earlier partition (usually of the previous version of the dataset,
``graphstore.lookup.resolve_stable_from``). Its ``assignment.parquet`` says where each of its nodes
lives; nodes that still exist keep that part, nodes that no longer exist are dropped, and nodes it
does not know are placed by the method's objective:

- ``random``: into the smallest parts first, so that part sizes end as even as possible (seeded);
- ``metis`` / ``supernode``: greedy neighbour majority (``grow_from_neighbours``), within a
  capacity bound, then the rest by balance;
- ``column``: the column names every node's part; old nodes whose value changed count as moved.

All steps are vectorised over nodes and edges; the only Python loops run over rounds of the
greedy placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

CAPACITY_SLACK = 1.03  # greedy placement fills a part up to ceil(N / K * CAPACITY_SLACK) nodes
UNPLACED = -1


@dataclass(frozen=True)
class Placement:
    """The stable assignment and how it relates to the anchor (counts of nodes)."""

    part: np.ndarray  # (N,) int64 part of each node, 0..K-1
    kept: int  # anchor nodes still present, same part
    moved: int  # anchor nodes still present, another part
    new: int  # nodes the anchor does not have
    removed: int  # anchor nodes no longer in the dataset


def load_anchor(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(node_id (A,) int64, part (A,) int64) of the anchor partition stored at ``path``."""
    table = pq.read_table(path / "assignment.parquet", columns=["node_id", "part"])
    return (table.column("node_id").to_numpy().astype(np.int64, copy=False),
            table.column("part").to_numpy().astype(np.int64, copy=False))


def carry_over(node_id: np.ndarray, anchor_id: np.ndarray, anchor_part: np.ndarray) -> tuple[np.ndarray, int]:
    """The anchor's part of each node ((N,) int64, ``UNPLACED`` for new nodes) and the number of
    anchor nodes that are gone. ``node_id`` (N,) is any order; anchor ids (A,) need not be sorted."""
    carried = np.full(len(node_id), UNPLACED, np.int64)
    if len(anchor_id) == 0:
        return carried, 0
    order = np.argsort(anchor_id, kind="stable")
    ids, parts = anchor_id[order], anchor_part[order]
    pos = np.minimum(np.searchsorted(ids, node_id), len(ids) - 1)
    found = ids[pos] == node_id
    carried[found] = parts[pos[found]]
    return carried, len(ids) - int(np.count_nonzero(found))


def balanced_quotas(sizes: np.ndarray, count: int) -> np.ndarray:
    """(K,) int64 nodes to add to each part so that ``count`` new nodes even out ``sizes`` (K,).

    Water filling: the smallest parts are raised to a common level first; parts already above the
    level get nothing. Quotas sum to ``count``; the remainder goes to the lowest part ids among the
    parts being filled.
    """
    order = np.argsort(sizes, kind="stable")
    sorted_sizes = sizes[order].astype(np.int64)
    prefix = np.cumsum(sorted_sizes)
    k = np.arange(1, len(sizes) + 1)
    filled = int(np.count_nonzero(sorted_sizes * k <= count + prefix))  # parts raised to the level
    total = count + int(prefix[filled - 1])
    level, extra = divmod(total, filled)
    target = np.full(filled, level, np.int64)
    target[np.argsort(order[:filled], kind="stable")[:extra]] += 1
    quotas = np.zeros(len(sizes), np.int64)
    quotas[order[:filled]] = target - sorted_sizes[:filled]
    return quotas


def fill_balanced(part: np.ndarray, parts: int, seed: int) -> np.ndarray:
    """``part`` (N,) with every ``UNPLACED`` node dealt to the parts by ``balanced_quotas`` (seeded
    order); placed nodes are unchanged."""
    part = part.copy()
    unplaced = np.flatnonzero(part == UNPLACED)
    if len(unplaced) == 0:
        return part
    sizes = np.bincount(part[part != UNPLACED], minlength=parts)
    labels = np.repeat(np.arange(parts, dtype=np.int64), balanced_quotas(sizes, len(unplaced)))
    part[np.random.default_rng(seed).permutation(unplaced)] = labels
    return part


def majority_part(node: np.ndarray, neighbour_part: np.ndarray, parts: int,
                  sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For (node, part of a placed neighbour) pairs (P,): each distinct node (F,), the part holding
    most of its placed neighbours (F,) and that number of neighbours (F,).

    The (node, part) pairs are counted sparsely (``np.unique`` of ``node * K + part``, memory
    O(P) rather than a dense (F, K) ``bincount``). Ties go to the smaller part, then the lower id.
    """
    keys, votes = np.unique(node * parts + neighbour_part, return_counts=True)
    nodes, best = np.divmod(keys, parts)
    order = np.lexsort((best, sizes[best], -votes, nodes))  # by node, most votes, smallest part, id
    nodes, best, votes = nodes[order], best[order], votes[order]
    first = np.ones(len(nodes), bool)
    first[1:] = nodes[1:] != nodes[:-1]
    return nodes[first], best[first], votes[first]


def within_room(best: np.ndarray, votes: np.ndarray, room: np.ndarray) -> np.ndarray:
    """(F,) bool: which candidates (F,) fit into their part's ``room`` (K,), strongest votes first."""
    order = np.lexsort((-votes, best))  # grouped by part, most votes first (ties: candidate order)
    grouped = best[order]
    rank = np.arange(len(order)) - np.searchsorted(grouped, grouped)  # position within the part's group
    accept = np.zeros(len(best), bool)
    accept[order] = rank < room[grouped]
    return accept


def grow_from_neighbours(part: np.ndarray, src: np.ndarray, dst: np.ndarray, parts: int, seed: int,
                         slack: float = CAPACITY_SLACK) -> np.ndarray:
    """``part`` (N,) with the ``UNPLACED`` nodes placed by greedy neighbour majority.

    Each round, every unplaced node with placed neighbours (over edges ``src``/``dst`` (E,) row
    positions, either direction) goes to the part holding most of them, as long as that part has
    fewer than ``ceil(N / K * slack)`` nodes (parts already full are not offered); a full part
    takes its strongest candidates first. Placed nodes count in the next round, so new nodes grow
    outwards from the old ones. Nodes never reached (no placed neighbour, or only full parts
    around them) are dealt by ``fill_balanced``. Placed nodes never move.
    """
    part = part.copy()
    capacity = math.ceil(len(part) / parts * slack)
    sizes = np.bincount(part[part != UNPLACED], minlength=parts)
    into_src, into_dst = part[src] == UNPLACED, part[dst] == UNPLACED  # edge ends still to place
    node = np.concatenate([src[into_src], dst[into_dst]]).astype(np.int64, copy=False)  # (P,) unplaced end
    neighbour = np.concatenate([dst[into_src], src[into_dst]]).astype(np.int64, copy=False)  # (P,) other end
    del into_src, into_dst
    while len(node):
        room = capacity - sizes
        neighbour_part = part[neighbour]
        offered = neighbour_part != UNPLACED
        offered[offered] = room[neighbour_part[offered]] > 0
        if not offered.any():
            break
        candidate, best, votes = majority_part(node[offered], neighbour_part[offered], parts, sizes)
        accept = within_room(best, votes, room)
        part[candidate[accept]] = best[accept]
        sizes += np.bincount(best[accept], minlength=parts)
        still = part[node] == UNPLACED
        node, neighbour = node[still], neighbour[still]
    return fill_balanced(part, parts, seed)


def summarise(carried: np.ndarray, part: np.ndarray, removed: int) -> Placement:
    """A ``Placement`` of ``part`` (N,) against the anchor's parts ``carried`` (N,, ``UNPLACED`` = new)."""
    old = carried != UNPLACED
    moved = int(np.count_nonzero(old & (part != carried)))
    return Placement(part=part, kept=int(np.count_nonzero(old)) - moved, moved=moved,
                     new=int(len(part) - np.count_nonzero(old)), removed=removed)
