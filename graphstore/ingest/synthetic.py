"""Stochastic block model with label-correlated features, generated and written in chunks.

Each undirected edge picks a uniform endpoint u; with probability ``homophily`` the other endpoint
is uniform within u's class, otherwise uniform within another class. Self loops and duplicates
are removed and replaced until exactly ``round(nodes * avg_degree / 2)`` undirected edges remain;
they are stored both ways. Features: ``signal * centroid[c] + N(0, noise^2)`` per node, with class
centroids drawn from N(0, 1), where c is the node's class, or, with probability ``class_overlap``,
another class drawn uniformly (a node that looks like another class: only its neighbourhood tells). Memory is about 50 bytes per directed edge plus 4 bytes per feature
value of one node chunk, so 1,000,000 nodes / 20,000,000 edges fit in about 1.5 GB.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from graphstore.ingest.splits import SplitFractions, stratified_split
from graphstore.limits import Estimate, synthetic_estimate
from graphstore.parquet_io import features_table
from graphstore.progress import Progress, no_progress

GENERATOR_VERSION = 3
HOMOPHILY, FEATURE_SIGNAL, CLASS_OVERLAP = 0.3, 0.3, 0.3  # defaults: see docs/ingest.md, "Synthetic graphs"
NODE_CHUNK = 100_000
EDGE_CHUNK = 2_000_000


class SyntheticOptions(BaseModel):
    """Parameters of the generated graph (all part of the dataset fingerprint)."""

    nodes: int = Field(gt=1, description="Number of nodes.")
    avg_degree: float = Field(gt=0, description="Average degree (directed edges = nodes x avg degree).")
    classes: int = Field(10, ge=2, description="Number of classes (blocks).")
    features: int = Field(64, ge=1, description="Feature width.")
    homophily: float = Field(HOMOPHILY, ge=0, le=1, description="Probability that an edge stays inside its class.")
    feature_signal: float = Field(FEATURE_SIGNAL, ge=0, description="Scale of the class centroid in the features.")
    feature_noise: float = Field(1.0, gt=0, description="Standard deviation of the Gaussian noise on every feature.")
    class_overlap: float = Field(CLASS_OVERLAP, ge=0, le=1, description="Probability that a node's features are "
                                 "drawn around another class's centroid.")
    seed: int = Field(0, ge=0, description="Generator seed (also the seed of the stratified split).")


def memory_estimate(options: SyntheticOptions) -> Estimate:
    """The generator's peak memory (see the module docstring)."""
    return synthetic_estimate(options.nodes, options.avg_degree, options.features, NODE_CHUNK)


def sample_labels(options: SyntheticOptions, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, options.classes, options.nodes).astype(np.int64)


def candidate_pairs(options: SyntheticOptions, label: np.ndarray, members: np.ndarray, sizes: np.ndarray,
                    starts: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Keys ``min(u,v) * N + max(u,v)`` of ``count`` sampled pairs (self loops dropped, may repeat)."""
    n = options.nodes
    u = rng.integers(0, n, count)
    cls = label[u]
    other = (cls + rng.integers(1, options.classes, count)) % options.classes
    pick = np.where(rng.random(count) < options.homophily, cls, other)
    pick_sizes = sizes[pick]
    ok = pick_sizes > 0
    v = members[starts[pick[ok]] + (rng.random(int(ok.sum())) * pick_sizes[ok]).astype(np.int64)]
    u = u[ok]
    keep = u != v
    lo, hi = np.minimum(u[keep], v[keep]), np.maximum(u[keep], v[keep])
    return lo.astype(np.int64) * n + hi


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (by sorting in place: numpy's hashing ``unique`` is several times
    slower on tens of millions of integers)."""
    values.sort()
    keep = np.ones(len(values), bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep]


def sample_undirected_pairs(options: SyntheticOptions, label: np.ndarray, rng: np.random.Generator,
                            progress: Progress = no_progress) -> np.ndarray:
    """Sorted unique keys ``min(u,v) * N + max(u,v)`` of exactly round(N * D / 2) edges.

    Candidates are drawn in chunks of ``EDGE_CHUNK`` until, after removing duplicates (one sort of
    everything drawn so far per top-up; duplicates are rare, so one or two top-ups), at least the
    target remain; a uniform subset of exactly the target is kept. O(E log E) time, about 16 bytes
    per candidate of memory.
    """
    n = options.nodes
    target = int(round(n * options.avg_degree / 2))
    if target > n * (n - 1) // 2:
        raise ValueError(f"avg_degree {options.avg_degree} is too high for {n} nodes")
    members = np.argsort(label, kind="stable")
    sizes = np.bincount(label, minlength=options.classes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    keys = np.empty(0, np.int64)
    while len(keys) < target:
        wanted = int((target - len(keys)) * 1.05) + 16
        drawn = [keys]
        for start in range(0, wanted, EDGE_CHUNK):
            drawn.append(candidate_pairs(options, label, members, sizes, starts, min(EDGE_CHUNK, wanted - start), rng))
            progress("edges", min(len(keys) + start + EDGE_CHUNK, target), target)
        keys = sorted_unique(np.concatenate(drawn))
    if len(keys) > target:
        keys = np.sort(keys[rng.choice(len(keys), target, replace=False)])
    progress("edges", target, target)
    return keys


def generate_features(options: SyntheticOptions, label: np.ndarray, rng: np.random.Generator,
                      progress: Progress = no_progress) -> Iterator[pa.Table]:
    """Feature tables of ``NODE_CHUNK`` rows in node order."""
    centroids = rng.standard_normal((options.classes, options.features)).astype(np.float32)
    for start in range(0, options.nodes, NODE_CHUNK):
        ids = np.arange(start, min(start + NODE_CHUNK, options.nodes), dtype=np.int64)
        looks_like = label[ids].copy()
        other = rng.random(len(ids)) < options.class_overlap
        looks_like[other] = (looks_like[other] + rng.integers(1, options.classes, int(other.sum()))) % options.classes
        noise = rng.standard_normal((len(ids), options.features), dtype=np.float32) * np.float32(options.feature_noise)
        yield features_table(ids, options.feature_signal * centroids[looks_like] + noise)
        progress("features", int(ids[-1]) + 1, options.nodes)


def directed_edge_chunks(keys: np.ndarray, n: int, progress: Progress = no_progress) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Both directions of every undirected key, sorted by (src, dst), in chunks."""
    lo, hi = np.divmod(keys, n)
    both = np.concatenate([keys, hi * n + lo])
    del lo, hi
    both.sort()
    for start in range(0, len(both), EDGE_CHUNK):
        src, dst = np.divmod(both[start:start + EDGE_CHUNK], n)
        yield src, dst
        progress("write edges", min(start + EDGE_CHUNK, len(both)), len(both))


def synthetic_nodes(options: SyntheticOptions, label: np.ndarray, fractions: SplitFractions) -> pa.Table:
    return pa.table({
        "node_id": pa.array(np.arange(options.nodes), pa.int64()),
        "label": pa.array(label, pa.int64()),
        "split": pa.array(stratified_split(label, fractions), pa.string()),
    })
