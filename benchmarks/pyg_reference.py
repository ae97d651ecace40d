"""The honest reference: a plain two-layer PyG model per architecture, trained the way PyG's own
examples train it, *not* with the project's recipe (so that it can show a project default wrong).

What PyG's examples do (``examples/gcn.py``, ``examples/gat.py``, ``examples/reddit.py`` of
pyg-team/pytorch_geometric), and what the reference does:

- features as the data gives them; row-normalised by PyG's own ``T.NormalizeFeatures()`` only for
  a dataset ingested from Planetoid files (the dataset manifest's ``source.kind == "planetoid"``),
  because PyG's Planetoid examples load those with that transform and no other example normalises;
- ``GCNConv(cached=True)`` with its default symmetric normalisation and self loops;
  ``SAGEConv`` (mean); ``GATConv`` with 4 heads of hidden / 4 channels, concatenated, and a last
  layer with one head (``concat=False``);
- dropout 0.5 on the input of each conv; ReLU between the convs for GCN and SAGE, ELU for GAT (as
  ``examples/gat.py``, which also drops attention coefficients at its dropout rate: here 0.5);
- Adam, lr 0.01, weight decay 5e-4: on the first conv only for GCN (``examples/gcn.py``), on every
  parameter for SAGE and GAT (``examples/gat.py``). PyG has no full-batch SAGE example (its
  supervised SAGE examples sample mini-batches, e.g. ``examples/reddit.py``: dropout between the
  convs only, no weight decay), so SAGE takes the layout of the full-batch examples above;
- 200 epochs, full batch, cross-entropy averaged over the train nodes, an evaluation after every
  epoch, and the test metric of the epoch with the best validation metric (first best wins). The
  metric is accuracy, or ROC-AUC (``retexo_core.metrics.roc_auc`` of the class-1 probability) for
  a two-class label, for selection and report alike.

With ``sparse_input`` (what ``benchmarks/accuracy.py`` uses), GCN's and GAT's first conv reads
sparse features (under 10% non-zero) as a CSR tensor: the same product ``x @ W`` by a sparse
kernel (20 epochs of GCN on coauthor_cs: 9 s against 71 s), and input dropout drops its stored entries
(the zeros of a dense tensor stay zero under dropout, so the distribution is the same; the random
draws differ). SAGE aggregates its input before its linear map, so it keeps dense features.

Hidden size 256, the project's default (PyG's examples use 16 for GCN and 8 x 8 for GAT); learning
rate 0.01 and dropout 0.5 for every architecture (``examples/gat.py`` uses 0.005 and 0.6), as the
issue's recipe fixes them.

``train_plain`` takes every knob explicitly (``PlainRecipe``) and optional initial parameters, so
that a test can train PyG with another recipe (``tests/test_reference_recipe.py`` gives it the
project's initial weights with dropout off and compares the losses epoch by epoch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from graphstore.lookup import DatasetRef
from graphstore.parquet_io import features_of
from retexo_core.metrics import roc_auc

Model = Literal["gcn", "sage", "gat"]


@dataclass
class PlainGraph:
    """A whole dataset as dense tensors (small graphs only), features as stored (raw)."""

    x: torch.Tensor  # (N, F) float32 features as the data gives them
    edge_index: torch.Tensor  # (2, E) int64 row positions, source -> target
    y: torch.Tensor  # (N,) int64 labels (-1: unknown)
    masks: dict[str, torch.Tensor]  # split -> (N,) bool, labelled nodes only
    num_classes: int
    source: str  # how the dataset was ingested: the manifest's source kind (planetoid, npz, tables, ...)


def load_plain(dataset: DatasetRef) -> PlainGraph:
    """The dataset's nodes, features and edges as dense tensors, rows in node-id order."""
    manifest = dataset.manifest
    nodes = pq.read_table(dataset.path / "nodes.parquet", columns=["node_id", "label", "split"])
    features = pq.read_table(dataset.path / "features.parquet")
    node_id = nodes.column("node_id").to_numpy()
    if not np.array_equal(features.column("node_id").to_numpy(), node_id) or np.any(np.diff(node_id) <= 0):
        raise ValueError(f"{dataset.path}: nodes.parquet and features.parquet must list the same sorted node ids")
    x = features_of(features, dataset.num_features)
    x = torch.from_numpy(np.asarray(x.toarray() if hasattr(x, "toarray") else x)).float()
    edges = pq.read_table(dataset.path / "edges.parquet")
    positions = [np.searchsorted(node_id, edges.column(c).to_numpy()) for c in ("src", "dst")]
    y = torch.from_numpy(nodes.column("label").to_numpy().astype(np.int64))
    split = nodes.column("split").to_numpy(zero_copy_only=False)
    masks = {s: torch.from_numpy(split == s) & (y >= 0) for s in ("train", "val", "test")}
    return PlainGraph(x, torch.from_numpy(np.stack(positions)).long(), y, masks, manifest.num_classes,
                      str(manifest.source.get("kind", "unknown")))


@dataclass(frozen=True)
class PlainRecipe:
    """Every knob of a plain PyG training run."""

    normalize: bool  # row-normalise the features (T.NormalizeFeatures)
    dropout: float = 0.5  # on the input of each conv
    attention_dropout: float = 0.0  # GAT: on the attention coefficients (GATConv's dropout)
    activation: Literal["relu", "elu"] = "relu"
    lr: float = 0.01
    weight_decay: float = 5e-4
    decay_layers: Literal["first", "all"] = "all"  # the convs whose parameters get the weight decay
    epochs: int = 200


def example_recipe(graph: PlainGraph, model: Model, epochs: int = 200) -> PlainRecipe:
    """PyG's example recipe for ``model`` on ``graph`` (see the module docstring)."""
    gat = model == "gat"
    return PlainRecipe(normalize=graph.source == "planetoid", attention_dropout=0.5 if gat else 0.0,
                       activation="elu" if gat else "relu", decay_layers="first" if model == "gcn" else "all",
                       epochs=epochs)


def plain_convs(model: Model, in_dim: int, hidden: int, classes: int, heads: int,
                attention_dropout: float) -> torch.nn.ModuleList:
    """The two PyG convs of ``model``."""
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    if model == "gcn":
        return torch.nn.ModuleList([GCNConv(in_dim, hidden, cached=True), GCNConv(hidden, classes, cached=True)])
    if model == "sage":
        return torch.nn.ModuleList([SAGEConv(in_dim, hidden), SAGEConv(hidden, classes)])
    return torch.nn.ModuleList([GATConv(in_dim, hidden // heads, heads=heads, dropout=attention_dropout),
                                GATConv(hidden, classes, heads=1, concat=False, dropout=attention_dropout)])


def score(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> float:
    """Accuracy, or the ROC-AUC of the class-1 probability for two classes. ``logits``: (n, C)."""
    if num_classes == 2:
        return roc_auc(torch.softmax(logits, dim=1)[:, 1].double().cpu().numpy(), y.cpu().numpy())
    return float((logits.argmax(1) == y).float().mean())


@dataclass
class PlainRun:
    """What ``train_plain`` measured. ``history``: one row per epoch, after its step: ``loss`` (the
    step's training loss, as PyG's examples log it), ``train_loss`` / ``val_loss`` (the mean
    cross-entropy of the evaluation pass, model in eval mode after the step), ``val`` / ``test``
    (the metric)."""

    best_val: float
    test_at_best: float
    best_epoch: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def input_dropout(h: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Dropout of a conv's input; for a sparse CSR tensor, of its stored entries."""
    if h.layout != torch.sparse_csr:
        return F.dropout(h, rate, training)
    values = F.dropout(h.values(), rate, training)
    # h's own indices, valid by construction: unchecked, as retexo_core.sparse builds its CSR tensors
    return torch.sparse_csr_tensor(h.crow_indices(), h.col_indices(), values, h.shape, check_invariants=False)


def train_plain(graph: PlainGraph, model: Model, hidden: int, recipe: PlainRecipe, seed: int = 0, heads: int = 4,
                initial: list[dict[str, torch.Tensor]] | None = None, device: str = "cpu",
                sparse_input: bool = False) -> PlainRun:
    """Train one plain PyG model full batch with ``recipe`` on ``device`` (as PyG's examples: the
    model and the whole graph moved there); ``initial``: each conv's state dict to start from
    (PyG's own initialisation from ``seed`` otherwise); ``sparse_input``: GCN's and GAT's first conv
    reads features under 10% non-zero as a CSR tensor (module docstring)."""
    import torch_geometric.transforms as T
    from torch_geometric.data import Data
    from torch_geometric.utils import to_torch_csr_tensor

    torch.manual_seed(seed)
    x = T.NormalizeFeatures()(Data(x=graph.x)).x if recipe.normalize else graph.x
    convs = plain_convs(model, x.shape[1], hidden, graph.num_classes, heads, recipe.attention_dropout)
    for conv, state in zip(convs, initial or []):
        conv.load_state_dict(state)
    if sparse_input and model != "sage" and float((x != 0).float().mean()) < 0.1:
        x = x.to_sparse_csr()
    convs, x = convs.to(device), x.to(device)
    activation = F.elu if recipe.activation == "elu" else F.relu
    # GCN and SAGE propagate with a sparse adjacency (adj_t[target, source], as PyG's large-graph
    # examples after T.ToSparseTensor): the same sums as with edge_index, 5-10x faster on one core
    edges = graph.edge_index if model == "gat" else to_torch_csr_tensor(graph.edge_index.flip(0),
                                                                         size=(len(graph.y), len(graph.y)))
    edges = edges.to(device)

    def forward() -> torch.Tensor:
        h = x
        for k, conv in enumerate(convs):
            h = conv(input_dropout(h, recipe.dropout, convs.training), edges)
            if k < len(convs) - 1:
                h = activation(h)
        return h

    decayed = convs if recipe.decay_layers == "all" else convs[:1]
    chosen = {id(p) for p in decayed.parameters()}
    optimizer = torch.optim.Adam([
        {"params": [p for p in convs.parameters() if id(p) in chosen], "weight_decay": recipe.weight_decay},
        {"params": [p for p in convs.parameters() if id(p) not in chosen], "weight_decay": 0.0},
    ], lr=recipe.lr)
    y, masks = graph.y.to(device), {split: mask.to(device) for split, mask in graph.masks.items()}
    run = PlainRun(best_val=-float("inf"), test_at_best=float("nan"), best_epoch=-1, seconds=0.0)
    started = time.perf_counter()
    for epoch in range(recipe.epochs):
        convs.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(forward()[masks["train"]], y[masks["train"]])
        loss.backward()
        optimizer.step()
        convs.eval()
        with torch.no_grad():
            logits = forward()
        row = {"epoch": epoch, "loss": float(loss.detach())}
        for split in ("train", "val"):
            row[f"{split}_loss"] = float(F.cross_entropy(logits[masks[split]], y[masks[split]]))
        for split in ("val", "test"):
            row[split] = score(logits[masks[split]], y[masks[split]], graph.num_classes)
        run.history.append(row)
        if row["val"] > run.best_val:
            run.best_val, run.test_at_best, run.best_epoch = row["val"], row["test"], epoch
    run.seconds = time.perf_counter() - started
    return run


def pyg_reference(graph: PlainGraph, model: Model = "gcn", hidden: int = 256, epochs: int = 200, seed: int = 0,
                  heads: int = 4, device: str = "cpu", sparse_input: bool = False) -> dict[str, float | None]:
    """PyG's example recipe for ``model`` on ``graph`` on ``device``; returns wall / train seconds,
    rounds, the val and test metric (accuracy, or ROC-AUC for two classes) of the best validation
    epoch and, on a GPU, the peak memory it allocated (GB)."""
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats(device)
    run = train_plain(graph, model, hidden, example_recipe(graph, model, epochs), seed, heads, device=device,
                      sparse_input=sparse_input)
    gpu_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device != "cpu" else None
    return {"wall_s": run.seconds, "train_s": run.seconds, "rounds": epochs, "val_acc": run.best_val,
            "test_acc": run.test_at_best, "gpu_gb": gpu_gb}


if __name__ == "__main__":
    import argparse
    import statistics

    from graphstore.layout import Store
    from graphstore.lookup import find_dataset

    parser = argparse.ArgumentParser(description="PyG's example recipe on datasets of a store (mean over seeds).")
    parser.add_argument("store")
    parser.add_argument("datasets", nargs="+")
    parser.add_argument("--model", default="gcn", choices=["gcn", "sage", "gat"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    store = Store.open(args.store)
    for name in args.datasets:
        graph = load_plain(find_dataset(store, name))
        runs = [pyg_reference(graph, args.model, args.hidden, 200, seed) for seed in range(args.seeds)]
        val, test = ([r[k] for r in runs] for k in ("val_acc", "test_acc"))
        metric = "ROC-AUC" if graph.num_classes == 2 else "accuracy"
        print(f"{name} ({graph.source}, features {'row-normalised' if graph.source == 'planetoid' else 'raw'}) "
              f"{args.model} {metric}: val {statistics.mean(val):.4f} ± {statistics.pstdev(val):.4f}, "
              f"test {statistics.mean(test):.4f} ± {statistics.pstdev(test):.4f} "
              f"({statistics.mean(r['wall_s'] for r in runs):.1f} s per seed)")
