"""A plain-torch probe of the layer-wise gap: the last two layers trained together at the ranks.

Layer-wise training fits each layer greedily on frozen inputs. This probe asks whether training the
last two layers together, exactly, closes the gap to end-to-end training, and what it would cost a
distributed run. It does not use the project's training code: GCN blocks (``conv`` plus, where the
graph's recipe has them, a skip connection and LayerNorm), Adam 0.01, weight decay 5e-4 on the
first layer, 200 rounds per stage, the best validation round kept.

Why the last two layers can train together without a per-round exchange: layer L−1's output at a
halo node u is ``relu(W·(Â·Z)_u + S·Z_u)``, where Z is layer L−1's input. The rank already
receives Z_u in layer L−1's halo exchange; with (Â·Z)_u as well, which u's owner computes once,
the rank computes layer L−1's output at its halo nodes itself, in every round, with the current
(synchronised) parameters, and layer L's aggregation over its owned nodes' in-edges is exact. So
the last two layers train as end-to-end training would, with gradient sync only; the price is one
more halo exchange of the same rows as layer L−1's (the aggregates instead of the inputs) and the
compute of layer L−1 at the halo nodes. With two layers it is end-to-end training.

Ranks are simulated in one process, exactly as they would compute: 4 random parts (seed 0); rank r
holds its owned rows and its halo rows (in-neighbours of its owned nodes in other parts), draws its
own dropout masks, and the gradients of the ranks' losses are summed (the all-reduce).

Modes (one JSON row per seed on stdout; ``extra_mb``: the extra exchange's bytes, float32):

- ``layerwise``: every layer greedily, with a linear auxiliary head on hidden layers;
- ``finetune``: ``layerwise``, then the last two layers together from their greedy parameters (the
  greedy model is kept where no round beats it on validation);
- ``joint``: layers 1..L−2 greedily, then the last two together from a fresh start;
- ``endtoend``: the whole model in one process.

    .venv/bin/python benchmarks/joint_last_layers.py minesweeper finetune --layers 3 --seeds 3
    .venv/bin/python benchmarks/joint_last_layers.py citeseer joint --layers 2 --seeds 5
    .venv/bin/python benchmarks/joint_last_layers.py chameleon_filtered finetune --layers 2 --seeds 10
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from graphstore.ingest.planetoid import load_planetoid  # noqa: E402  (the project's reader of the original files)
from retexo_core.metrics import roc_auc  # noqa: E402

HIDDEN, ROUNDS, PARTS, LR, DECAY = 256, 200, 4, 0.01, 5e-4
DATASETS = REPO.parent / "shared" / "datasets"


@dataclass
class Graph:
    """A graph with Â = D^-1/2 (A + I) D^-1/2 and its split masks."""

    x: torch.Tensor  # (n, d) features
    y: torch.Tensor  # (n,) labels
    src: torch.Tensor  # (m,) edge sources, self-loops included, both directions
    dst: torch.Tensor  # (m,) edge targets
    weight: torch.Tensor  # (m,) Â's entries
    masks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per seed: train, val, test (n,) bool
    auc: bool  # score by ROC-AUC (two classes) instead of accuracy
    skip: bool  # the recipe: a skip connection, LayerNorm, dropout rate
    norm: bool
    dropout: float

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def classes(self) -> int:
        return int(self.y.max()) + 1

    def adjacency(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Â restricted to target nodes ``rows`` and source nodes ``cols``: (len(rows), len(cols)) CSR."""
        at_row = torch.full((self.n,), -1)
        at_row[rows] = torch.arange(len(rows))
        at_col = torch.full((self.n,), -1)
        at_col[cols] = torch.arange(len(cols))
        keep = (at_row[self.dst] >= 0) & (at_col[self.src] >= 0)
        index = torch.stack([at_row[self.dst[keep]], at_col[self.src[keep]]])
        return torch.sparse_coo_tensor(index, self.weight[keep], (len(rows), len(cols))).coalesce().to_sparse_csr()

    def score(self, logits: torch.Tensor, mask: torch.Tensor) -> float:
        if self.auc:
            return roc_auc(logits[mask].softmax(1)[:, 1].detach().numpy(), self.y[mask].numpy())
        return (logits[mask].argmax(1) == self.y[mask]).float().mean().item()


def with_adjacency(x: torch.Tensor, y: torch.Tensor, edges: torch.Tensor, **kwargs: object) -> Graph:
    """``edges`` (2, m) in either direction, any duplicates or self-loops: GCN's normalised Â."""
    n = len(y)
    both = torch.unique(torch.cat([edges, edges.flip(0)], 1), dim=1)
    both = both[:, both[0] != both[1]]
    loops = torch.arange(n)
    src, dst = torch.cat([both[0], loops]), torch.cat([both[1], loops])
    degree = torch.zeros(n).index_add_(0, dst, torch.ones(len(dst)))
    return Graph(x, y, src, dst, degree[src].rsqrt() * degree[dst].rsqrt(), **kwargs)  # type: ignore[arg-type]


def load(name: str, datasets: Path) -> Graph:
    """A graph of the suite with a fixed recipe: the npz graphs with their official splits, raw
    features and a skip connection (minesweeper: also LayerNorm and dropout 0.2, the recipe
    `centralized` chose there; ROC-AUC), the Planetoid graphs with their public split,
    row-normalised features, no skip connection, dropout 0.5."""
    if name not in ("cora", "citeseer"):
        data = np.load(datasets / name / f"{name}.npz")
        masks = [tuple(torch.tensor(data[k][s]) for k in ("train_masks", "val_masks", "test_masks"))
                 for s in range(len(data["train_masks"]))]
        y = torch.tensor(data["node_labels"])
        mines = name == "minesweeper"
        return with_adjacency(torch.tensor(data["node_features"]).float(), y, torch.tensor(data["edges"]).t(),
                              masks=masks, auc=int(y.max()) == 1, skip=True, norm=mines, dropout=0.2 if mines else 0.5)
    plain = load_planetoid(datasets / name)
    x = torch.tensor(plain.x.toarray() if hasattr(plain.x, "toarray") else plain.x, dtype=torch.float32)
    x = x / x.sum(1, keepdim=True).clamp(min=1)
    split = tuple(torch.tensor(plain.split == k) for k in ("train", "val", "test"))
    y = torch.tensor(plain.label).clamp(min=0)  # unlabelled rows (CiteSeer's padding) are in no split
    edges = torch.tensor(np.stack([plain.src, plain.dst]))
    return with_adjacency(x, y, edges, masks=[split] * 100, auc=False, skip=False, norm=False, dropout=0.5)


class Block(nn.Module):
    """``conv`` (+ skip) (+ LayerNorm, ReLU on hidden blocks), dropout on its inputs after aggregation."""

    def __init__(self, graph: Graph, in_dim: int, out_dim: int, last: bool):
        super().__init__()
        self.p, self.last = graph.dropout, last
        self.lin = nn.Linear(in_dim, out_dim)
        self.skip = nn.Linear(in_dim, out_dim, bias=False) if graph.skip else None
        self.norm = nn.LayerNorm(out_dim) if graph.norm and not last else None

    def forward(self, aggregated: torch.Tensor, own: torch.Tensor, train: bool) -> torch.Tensor:
        """(rows, in) Â·Z and Z of the same rows -> (rows, out)."""
        h = self.lin(F.dropout(aggregated, self.p, train))
        if self.skip is not None:
            h = h + self.skip(F.dropout(own, self.p, train))
        if self.last:
            return h
        return F.relu(self.norm(h) if self.norm is not None else h)


def adam(modules: list[nn.Module], decay: bool) -> torch.optim.Adam:
    return torch.optim.Adam([p for m in modules for p in m.parameters()], lr=LR, weight_decay=DECAY if decay else 0.0)


@dataclass
class Best:
    val: float = -1.0
    test: float = 0.0
    round: int = -1
    state: dict[str, torch.Tensor] | None = None


def greedy_layer(graph: Graph, z: torch.Tensor, adj: torch.Tensor, split: tuple[torch.Tensor, ...],
                 first: bool, last: bool) -> tuple[torch.Tensor, Best]:
    """One layer fitted alone on frozen inputs ``z`` (n, d): its (n, out) outputs and its best round."""
    train, val, test = split
    aggregated = adj @ z
    block = Block(graph, z.shape[1], graph.classes if last else HIDDEN, last)
    head = None if last else nn.Linear(HIDDEN, graph.classes)
    optimizer = adam([block] + ([head] if head is not None else []), first)
    best = Best()
    for round_ in range(ROUNDS):
        for training in (True, False):
            block.train(training)
            h = block(aggregated, z, training)
            logits = h if head is None else head(F.dropout(h, graph.dropout, training))
            if training:
                optimizer.zero_grad()
                F.cross_entropy(logits[train], graph.y[train]).backward()
                optimizer.step()
            elif (score := graph.score(logits, val)) > best.val:
                state = {k: t.clone() for k, t in block.state_dict().items()}
                best = Best(score, graph.score(logits, test), round_, state)
    assert best.state is not None
    block.load_state_dict(best.state)
    with torch.no_grad():
        return block(aggregated, z, False), best


Rank = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def rank_inputs(graph: Graph, z: torch.Tensor, aggregated: torch.Tensor, parts: torch.Tensor) -> tuple[list[Rank], int]:
    """What each rank holds for layers L−1 and L: its owned nodes (o,), Â over their in-edges
    (o, o + h), and layer L−1's aggregated inputs Â·Z and inputs Z of its owned then halo rows
    (o + h, d), h being its halo (in-neighbours of owned nodes in other parts); and the bytes of the
    extra exchange, float32: every rank's halo rows of Â·Z (each owner aggregates its own nodes)."""
    ranks, extra = [], 0
    for r in range(int(parts.max()) + 1):
        owned = (parts == r).nonzero().squeeze(1)
        sources = graph.src[parts[graph.dst] == r]
        halo = torch.unique(sources[parts[sources] != r])
        rows = torch.cat([owned, halo])
        ranks.append((owned, graph.adjacency(owned, rows), aggregated[rows], z[rows]))
        extra += len(halo) * z.shape[1] * 4
    return ranks, extra


def last_two_together(graph: Graph, z: torch.Tensor, adj: torch.Tensor, split: tuple[torch.Tensor, ...],
                      first: bool, start: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None,
                      parts: torch.Tensor) -> tuple[Best, int]:
    """Layers L−1 and L trained together at the ranks from layer L−1's inputs ``z`` (n, d); the best
    round (-1: the start, where ``start`` gives one) and the extra exchange's bytes."""
    train, val, test = split
    aggregated = adj @ z
    ranks, extra = rank_inputs(graph, z, aggregated, parts)
    hidden, last = Block(graph, z.shape[1], HIDDEN, False), Block(graph, HIDDEN, graph.classes, True)
    if start is not None:
        hidden.load_state_dict(start[0])
        last.load_state_dict(start[1])
    optimizers = [adam([hidden], first), adam([last], False)]
    total = int(train.sum())

    def at_rank(rank: Rank, training: bool) -> torch.Tensor:
        """(owned, classes) logits of one rank's owned nodes."""
        owned, local, agg, own = rank
        h = hidden(agg, own, training)  # (owned + halo, hidden): the halo's rows computed here
        return last(local @ h, h[: len(owned)], training)

    def logits(training: bool) -> torch.Tensor:
        out = torch.zeros(graph.n, graph.classes)
        for rank in ranks:
            out[rank[0]] = at_rank(rank, training)
        return out

    with torch.no_grad():  # the ranks compute what the whole graph would (dropout off)
        h = hidden(aggregated, z, False)
        whole = last(adj @ h, h, False)
        start_logits = logits(False)
    assert torch.allclose(start_logits, whole, atol=1e-5), "the ranks' rows differ from the whole graph's"
    best = Best()
    if start is not None:
        best = Best(graph.score(start_logits, val), graph.score(start_logits, test), -1)
    for round_ in range(ROUNDS):
        hidden.train()
        last.train()
        for optimizer in optimizers:
            optimizer.zero_grad()
        for rank in ranks:  # each rank's loss; the summed gradients are the all-reduce
            owned = rank[0]
            out = at_rank(rank, True)
            mine = train[owned]
            (F.cross_entropy(out[mine], graph.y[owned][mine], reduction="sum") / total).backward()
        for optimizer in optimizers:
            optimizer.step()
        hidden.eval()
        last.eval()
        with torch.no_grad():
            now = logits(False)
        if (score := graph.score(now, val)) > best.val:
            best = Best(score, graph.score(now, test), round_)
    return best, extra


def end_to_end(graph: Graph, adj: torch.Tensor, split: tuple[torch.Tensor, ...], layers: int) -> Best:
    train, val, test = split
    dims = [graph.x.shape[1]] + [HIDDEN] * (layers - 1) + [graph.classes]
    blocks = nn.ModuleList(Block(graph, dims[k], dims[k + 1], k == layers - 1) for k in range(layers))
    optimizer = torch.optim.Adam([{"params": blocks[0].parameters(), "weight_decay": DECAY},
                                  {"params": [p for b in blocks[1:] for p in b.parameters()]}], lr=LR)
    best = Best()
    for epoch in range(ROUNDS):
        for training in (True, False):
            blocks.train(training)
            h = graph.x
            for block in blocks:
                h = block(adj @ h, h, training)
            if training:
                optimizer.zero_grad()
                F.cross_entropy(h[train], graph.y[train]).backward()
                optimizer.step()
            elif (score := graph.score(h, val)) > best.val:
                best = Best(score, graph.score(h, test), epoch)
    return best


def run(graph: Graph, adj: torch.Tensor, mode: str, layers: int, seed: int) -> tuple[Best, int]:
    """One seed (split ``seed`` where the graph has several) of ``mode`` with the graph's whole Â
    ``adj`` (n, n): its best and the extra bytes."""
    torch.manual_seed(seed)
    split = graph.masks[seed]
    if mode == "endtoend":
        return end_to_end(graph, adj, split, layers), 0
    parts = torch.randint(0, PARTS, (graph.n,), generator=torch.Generator().manual_seed(0))
    z, inputs, states, best = graph.x, [], [], Best()
    for layer in range(layers if mode in ("layerwise", "finetune") else layers - 2):
        inputs.append(z)
        z, best = greedy_layer(graph, z, adj, split, layer == 0, layer == layers - 1)
        states.append(best.state)
    if mode == "finetune":
        return last_two_together(graph, inputs[-2], adj, split, layers == 2, (states[-2], states[-1]), parts)
    if mode == "joint":
        return last_two_together(graph, z, adj, split, layers == 2, None, parts)
    return best, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("graph", help="cora, citeseer, or a graph of ../shared/datasets in npz with official splits")
    parser.add_argument("mode", choices=["layerwise", "finetune", "joint", "endtoend"])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--datasets", type=Path, default=DATASETS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    graph = load(args.graph, args.datasets)
    adj = graph.adjacency(torch.arange(graph.n), torch.arange(graph.n))
    for seed in range(args.seeds):
        best, extra = run(graph, adj, args.mode, args.layers, seed)
        print(json.dumps({"graph": args.graph, "mode": args.mode, "layers": args.layers, "seed": seed,
                          "val": round(best.val, 4), "test": round(best.test, 4), "round": best.round,
                          "extra_mb": round(extra / 1e6, 2)}), flush=True)


if __name__ == "__main__":
    main()
