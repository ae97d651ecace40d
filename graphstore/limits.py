"""Resource checks before work starts: the peak memory of an ingest, a partitioning or a training,
estimated from its inputs and compared with the memory available on this machine now.

A request whose estimate exceeds the available memory is refused with one line (what needs how
much, what is available, what to do) before anything is allocated; ``force`` turns the refusal
into a logged warning. The estimates are simple: a command's own process, plus bytes per node,
per edge and per feature value of the arrays each step holds at its peak, with the constants
below, calibrated on ``benchmarks/scale.py`` (synthetic graphs of 100k, 300k and 1M nodes, GCN and
SAGE): each estimate is within -10 % / +30 % of the measured peak of the command's whole process
tree (docs/scale.md prints them side by side). They also catch requests that cannot fit (a 5e9-node
graph, a 1e8-wide feature vocabulary times a hidden layer) before anything is allocated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil

from graphstore.errors import RetexoError
from graphstore.units import human_bytes

log = logging.getLogger(__name__)

# Bytes held at the peak, per item (see each estimate's docstring).
COMMAND_BASE = 256 * 2**20  # a command's own process: the Python interpreter, NumPy, Arrow (and torch for training)
SYNTHETIC_PER_EDGE = 24  # both directions of an edge, int64, held while its chunk is sorted and written
SYNTHETIC_PER_NODE = 64  # labels, class members, split strings
TABLE_PER_EDGE = 80  # Arrow columns, int64 copies, sort and de-duplication
TABLE_PER_NODE = 64
PARTITION_PER_EDGE = 170  # CSR adjacency, METIS's own graph and workspace, per-part edge lists (3.7 GB at 20M)
PARTITION_PER_NODE = 80
WORKER_BASE = 550 * 2**20  # one worker process: the Python interpreter, torch, gloo, Parquet buffers
ROW_COPIES = 8  # rows per owned node of a layer's widest row (inputs, aggregate, outputs, gradients, next inputs)
ACTIVATION_COPIES = 2  # end to end, per further layer: the hidden rows and their gradient
EDGE_BYTES = 64  # a local edge: its ids as read, the CSR adjacency (int64 column, float32 weight) and its transpose
ADAM_COPIES = 4  # a parameter, its gradient and Adam's two moments
CUDA_CONTEXT = 600 * 2**20  # a rank's CUDA context, cuBLAS / cuSPARSE workspaces and the caching allocator's slack
CUDA_HOST = 200 * 2**20  # what the CUDA runtime adds to a rank's host memory (0.17 GB measured on an H200, 1M nodes)


class ResourceError(RetexoError):
    """A request needs more memory (or processes) than this machine has."""


@dataclass(frozen=True)
class Estimate:
    """``what`` needs about ``bytes`` at its peak; ``advice`` says how to make it smaller."""

    what: str
    bytes: int
    advice: str

    def scaled(self, share: float) -> "Estimate":
        """The part ``share`` (0..1] of this estimate (one node's workers of a multi-node launch)."""
        return Estimate(self.what, int(self.bytes * share), self.advice)


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (``MemAvailable``)."""
    return int(psutil.virtual_memory().available)


def check_memory(estimate: Estimate, force: bool = False, available: int | None = None,
                 where: str = "on this machine") -> None:
    """Refuse ``estimate`` when it exceeds the available memory (a warning instead with ``force``);
    ``where`` names that memory (a GPU's)."""
    available = available_memory() if available is None else available
    if estimate.bytes <= available:
        return
    message = (f"{estimate.what} needs about {human_bytes(estimate.bytes)} of memory, but {human_bytes(available)} "
               f"is available {where}")
    if force:
        log.warning("%s; going on because of --force", message)
        return
    raise ResourceError(f"{message}; {estimate.advice}, or pass --force to try anyway")


def synthetic_estimate(nodes: int, avg_degree: float, features: int, node_chunk: int) -> Estimate:
    """A generated graph: its directed edges (``nodes * avg_degree``) and nodes are held whole, the
    features one chunk of ``node_chunk`` nodes at a time (float32, with two temporaries)."""
    edges = nodes * avg_degree
    needed = (COMMAND_BASE + edges * SYNTHETIC_PER_EDGE + nodes * SYNTHETIC_PER_NODE
              + min(nodes, node_chunk) * features * 4 * 3)
    return Estimate(f"generating {nodes:,} nodes and {edges:,.0f} edges", int(needed),
                    "use fewer nodes or a lower --avg-degree")


def tables_estimate(edge_rows: int, node_rows: int, feature_bytes: int, undirected: bool) -> Estimate:
    """Ingesting tables: every edge (twice when ``undirected``) and node row is held as int64
    arrays with sorting copies; ``feature_bytes`` is the decoded size of the feature matrix."""
    edges = edge_rows * (2 if undirected else 1)
    needed = COMMAND_BASE + edges * TABLE_PER_EDGE + node_rows * TABLE_PER_NODE + feature_bytes
    return Estimate(f"ingesting {node_rows:,} nodes and {edges:,} edges", int(needed),
                    "ingest a smaller graph or fewer feature columns")


def partition_estimate(nodes: int, edges: int, parts: int) -> Estimate:
    """Partitioning: the whole adjacency in CSR form (and METIS's copy of it) plus per-part lists."""
    needed = COMMAND_BASE + nodes * PARTITION_PER_NODE + edges * PARTITION_PER_EDGE
    return Estimate(f"partitioning {nodes:,} nodes and {edges:,} edges into {parts} parts", int(needed),
                    "partition a smaller graph")


@dataclass(frozen=True)
class TrainingSizes:
    """What a training's memory depends on: the graph (``feature_bytes``: its decoded feature
    matrix, N x F x 4 dense or its non-zeros x 8 sparse), the model and the ``workers`` that share
    the graph, and the partition's halo rows in all (0 for the whole graph)."""

    nodes: int
    edges: int
    features: int
    feature_bytes: int
    sparse: bool
    hidden: int
    layers: int
    workers: int
    halo_nodes: int
    heads: int = 1
    layerwise: bool = True
    joint: bool = False  # the last two layers train together after the greedy layers (retexo_core/strategies/joint.py)
    two_hop: bool = False  # GAT's pair: also the halo's in-edges and their sources' rows (retexo_core/two_hop.py)

    def worker_data(self) -> float:
        """Bytes one worker holds of the graph and the model, wherever it computes (see
        ``training_estimate``)."""
        share = 1.0 / self.workers
        owned = self.nodes * share * 1.1  # 10 % for imbalance between parts
        halo = self.halo_nodes * share
        width = max(self.feature_bytes / max(self.nodes, 1), self.hidden * 4)  # the widest row a layer holds
        if self.layerwise:
            rows = owned * ROW_COPIES * width + halo / max(self.workers - 1, 1) * width
            if self.joint:  # then layer L-1 runs at every owned and halo row, end to end with layer L
                sources = halo * 2 if self.two_hop else halo  # GAT: about as many two-hop rows as halo rows
                rows = max(rows, (owned + sources) * width * (ROW_COPIES + ACTIVATION_COPIES))
        else:
            rows = (owned + halo) * width * (ROW_COPIES + ACTIVATION_COPIES * max(self.layers - 1, 0))
        graph = self.edges * share * 1.1 * (EDGE_BYTES + 4 * self.heads) * (2 if self.two_hop else 1)
        model = (self.features * self.hidden + max(self.layers - 1, 0) * self.hidden * self.hidden) * 4 * ADAM_COPIES
        transpose = (self.features + 1) * 8 if self.sparse else 0
        return rows + graph + model + transpose


def training_estimate(sizes: TrainingSizes, on_gpu: bool = False) -> Estimate:
    """Training on one machine with ``sizes.workers`` processes, each holding 1/workers of the graph.

    Per worker: the process itself (``WORKER_BASE``); ``ROW_COPIES`` rows per owned node (10 % more
    for imbalance) of the widest layer's row, ``max(input row, hidden x 4 B)``: a layer's inputs,
    their aggregate, its outputs, their gradients and the rows written for the next layer; the halo
    rows of that width, one peer's at a time under layer-wise training (``halo_nodes / (workers -
    1)``: they are aggregated as they arrive), all of them and every layer's activations at once
    end to end; ``EDGE_BYTES`` per local edge (plus one float32 attention coefficient per GAT head);
    and the model, whose first layer is F x hidden, ``ADAM_COPIES`` times. A sparse input also keeps
    its transpose's row pointer, (F + 1) int64. The whole tree adds the launching command
    (``COMMAND_BASE``). Calibrated on ``benchmarks/scale.py`` (100k to 1M nodes, 8 workers, GCN and
    SAGE; see docs/scale.md). Workers that compute ``on_gpu`` also hold the CUDA runtime's host
    memory (``CUDA_HOST`` each). Where the last two layers train together (``joint``), layer L-1
    runs at every owned and halo row with layer L, so those rows count as end to end; GAT's pair
    (``two_hop``) also holds the halo's in-edges (counted as the owned nodes' again) and their
    sources' rows (counted as many as the halo's).
    """
    per_worker = WORKER_BASE + sizes.worker_data() + (CUDA_HOST if on_gpu else 0)
    advice = "use more parts over several machines (--nnodes), a smaller --hidden, or fewer input features"
    return Estimate(
        f"training with {sizes.workers} worker process(es) ({sizes.features:,} input features, hidden "
        f"{sizes.hidden}) on {sizes.nodes:,} nodes", int(per_worker * sizes.workers + COMMAND_BASE),
        advice + (", or --joint-rounds 0 (the last two layers together hold every halo row's activations)"
                  if sizes.joint else ""))


def gpu_estimate(sizes: TrainingSizes, gpu: str, ranks: int) -> Estimate:
    """The GPU memory of ``ranks`` training workers that share the GPU ``gpu``: each holds its data
    there as it would in host memory, plus ``CUDA_CONTEXT``."""
    needed = ranks * (CUDA_CONTEXT + sizes.worker_data())
    return Estimate(f"training {ranks} rank(s) on {gpu}", int(needed),
                    "use --batch-size, more parts (--parts, or more machines), or --device cpu")
