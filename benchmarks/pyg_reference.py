"""Plain PyG references: a two-layer GCN, GraphSAGE or GAT written the way PyG's examples write
them, trained full batch in one process on a dataset of the store.

The recipe is the one ``retexo train`` uses by default, so that a difference in accuracy comes
from the training strategy and not from the recipe: features row-normalised when they are
non-negative, dropout 0.5 before each layer, ReLU between the layers, Adam (lr 0.01) with weight
decay 5e-4 on the first layer only, 200 epochs, and the test accuracy of the epoch with the best
validation accuracy (first best wins).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from graphstore.lookup import DatasetRef
from graphstore.parquet_io import features_of


@dataclass
class PlainGraph:
    x: torch.Tensor  # (N, F) float32 features, row-normalised when non-negative
    edge_index: torch.Tensor  # (2, E) int64, source -> target
    y: torch.Tensor  # (N,) int64 labels
    masks: dict[str, torch.Tensor]  # split -> (N,) bool


def load_plain(dataset: DatasetRef) -> PlainGraph:
    """The whole dataset as dense tensors (small graphs only)."""
    nodes = pq.read_table(dataset.path / "nodes.parquet", columns=["label", "split"])
    x = features_of(pq.read_table(dataset.path / "features.parquet"), dataset.num_features)
    x = torch.from_numpy(np.asarray(x.toarray() if hasattr(x, "toarray") else x)).float()
    if bool((x >= 0).all()):
        x = x / x.sum(dim=1, keepdim=True).clamp(min=1e-12)
    edges = pq.read_table(dataset.path / "edges.parquet")
    edge_index = torch.from_numpy(np.stack([edges.column("src").to_numpy(), edges.column("dst").to_numpy()]))
    split = nodes.column("split").to_numpy(zero_copy_only=False)
    return PlainGraph(x, edge_index.long(), torch.from_numpy(nodes.column("label").to_numpy().copy()).long(),
                      {s: torch.from_numpy(split == s) for s in ("train", "val", "test")})


def plain_model(model: str, in_dim: int, hidden: int, classes: int, heads: int) -> torch.nn.ModuleList:
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    if model == "gcn":
        return torch.nn.ModuleList([GCNConv(in_dim, hidden, cached=True), GCNConv(hidden, classes, cached=True)])
    if model == "sage":
        return torch.nn.ModuleList([SAGEConv(in_dim, hidden), SAGEConv(hidden, classes)])
    return torch.nn.ModuleList([GATConv(in_dim, hidden // heads, heads=heads),
                                GATConv(hidden, classes, heads=1, concat=False)])


def pyg_reference(graph: PlainGraph, model: str = "gcn", hidden: int = 256, epochs: int = 200, seed: int = 0,
                  heads: int = 4) -> dict[str, float]:
    """Train one plain PyG model; returns wall/train seconds, rounds, val and test accuracy."""
    torch.manual_seed(seed)
    convs = plain_model(model, graph.x.shape[1], hidden, int(graph.y.max()) + 1, heads)

    def forward() -> torch.Tensor:
        h = graph.x
        for k, conv in enumerate(convs):
            h = conv(F.dropout(h, 0.5, convs.training), graph.edge_index)
            if k < len(convs) - 1:
                h = F.relu(h)
        return h

    optimizer = torch.optim.Adam([{"params": convs[0].parameters(), "weight_decay": 5e-4},
                                  {"params": convs[1].parameters(), "weight_decay": 0.0}], lr=0.01)
    train, val, test = graph.masks["train"], graph.masks["val"], graph.masks["test"]
    best_val, test_at_best = -1.0, 0.0
    started = time.perf_counter()
    for _ in range(epochs):
        convs.train()
        optimizer.zero_grad()
        F.cross_entropy(forward()[train], graph.y[train]).backward()
        optimizer.step()
        convs.eval()
        with torch.no_grad():
            pred = forward().argmax(1)
        val_acc = float((pred[val] == graph.y[val]).float().mean())
        if val_acc > best_val:
            best_val, test_at_best = val_acc, float((pred[test] == graph.y[test]).float().mean())
    seconds = time.perf_counter() - started
    return {"wall_s": seconds, "train_s": seconds, "rounds": epochs, "val_acc": best_val, "test_acc": test_at_best}
