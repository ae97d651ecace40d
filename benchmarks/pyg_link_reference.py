"""The honest reference for link prediction: a plain PyG GCN link predictor trained the way PyG's
own ``examples/link_pred.py`` (pyg-team/pytorch_geometric) trains it, *not* with the project's
recipe.

What the example does (Cora):

- loads ``Planetoid(name="Cora")`` with ``T.NormalizeFeatures()`` (each feature row divided by
  its sum) and ``T.RandomLinkSplit(num_val=0.05, num_test=0.1, is_undirected=True,
  add_negative_train_samples=False)``: each undirected edge is counted once; the training
  positives are the train edges once each, the training graph (message passing) holds them in
  both directions; val and test get as many stored negatives as positives; the *test* graph
  holds the train and the val edges, the val graph the train edges only;
- encoder ``GCNConv(F, 128) -> ReLU -> GCNConv(128, 64)`` (GCNConv's defaults: self loops,
  symmetric normalisation, not cached), no dropout; decoder the dot product of the two
  endpoints' embeddings (a logit);
- each epoch one full-batch step: a fresh ``negative_sampling(train edge_index, num_nodes,
  num_neg_samples=<number of train positives>, method="sparse")``, ``BCEWithLogitsLoss`` over the
  positives and these negatives, ``Adam(lr=0.01)``, no weight decay; 100 epochs;
- after every epoch it scores the val and the test pairs (sigmoid of the logits, sklearn's
  ``roc_auc_score``) and reports "the test ROC-AUC of the best validation epoch".

What this reference does: the same, with these deviations.

- Model selection: the example means to keep the test ROC-AUC of the epoch with the best
  validation ROC-AUC, but a typo (it assigns ``best_val`` where it compares ``best_val_auc``,
  which stays 0) makes it report the *last* epoch's test ROC-AUC. Here the epoch with the best
  validation ROC-AUC is taken (first best wins), as the example intends and as its earlier
  versions did.
- Metrics: the project's ``retexo_core.metrics`` (``roc_auc``, ``mean_reciprocal_rank``,
  ``hits_at_k``) on the raw dot-product logits, positives against the negatives of the same
  split. The example feeds float32 sigmoids to sklearn; the sigmoid is monotone, so the ROC-AUC is
  the same except where float32 sigmoids saturate to 1.0 and tie (the logits keep the order).
  MRR and Hits@K, which the example does not report, are taken at the same best epoch.
- Seeding: the example seeds nothing. Here ``torch.manual_seed(seed)`` (initial weights) and
  Python's ``random.seed(seed)`` (PyG's ``negative_sampling`` draws with ``random.sample``), so two
  runs with the same seed agree (on a multi-threaded CPU, GCNConv's scatter sums may still differ
  in the last bits over long runs); the ``__main__`` seeds the split the same way.
- Test graph: as in the example, the test pairs are scored with the val positives added to the
  training graph (both directions for an undirected graph); ``val_edges_at_test=False`` scores
  them on the training graph alone, as the val pairs are (an option the example does not have,
  for comparison with a pipeline that never passes messages over val edges).
- Data: the function takes numpy arrays (features, training edges, stored evaluation pairs) so
  that any split can be given; the ``__main__`` builds them from PyG's own ``Planetoid`` and
  ``RandomLinkSplit`` exactly as the example does (checking that the rebuilt test graph equals
  RandomLinkSplit's) and repeats it over several seeds. It reads the raw ``ind.<name>.*`` files
  from a local folder (no download) and first screens each pickle with the project's allow-list
  unpickler, since PyG's reader unpickles them unguarded. ``NormalizeFeatures`` is applied inside
  ``train_plain_link``, after the split rather than before it: row-wise, so the same features.
- Device: CPU only (the example moves everything to CUDA when it finds one). Not reproduced: the
  example's per-epoch print and its closing ``decode_all`` (all node pairs with a positive logit),
  which it computes and never uses.
- ``seconds`` times the whole epoch loop: each training step *and* the per-epoch evaluation of
  val and test, as the example's loop does.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from retexo_core.metrics import hits_at_k, mean_reciprocal_rank, roc_auc

log = logging.getLogger(__name__)

Pairs = tuple[np.ndarray, np.ndarray, np.ndarray]  # src (P,), dst (P,), label (P,) 0/1
SPLITS = ("val", "test")


@dataclass
class LinkReferenceResult:
    """What ``train_plain_link`` measured."""

    best_epoch: int  # 1-based epoch with the best validation ROC-AUC (first best wins)
    seconds: float  # wall time of the epoch loop (training steps and per-epoch evaluation)
    metrics: dict[str, dict[str, float]]  # "val" / "test" -> {"roc_auc", "mrr", "hits_at_k"} at best_epoch


class GCNLinkPredictor(torch.nn.Module):
    """Two GCN layers (ReLU between) and a dot-product decoder, the example's model."""

    def __init__(self, in_dim: int, hidden: int, out: int):
        from torch_geometric.nn import GCNConv

        super().__init__()
        self.conv1 = GCNConv(in_dim, hidden)
        self.conv2 = GCNConv(hidden, out)

    def encode(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """``x``: (N, F), ``edge_index``: (2, E) source -> target; returns (N, out) embeddings."""
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    @staticmethod
    def decode(z: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """``z``: (N, out), ``pairs``: (2, P); returns (P,) logits, the endpoints' dot products."""
        return (z[pairs[0]] * z[pairs[1]]).sum(dim=-1)


def is_undirected(edges: np.ndarray) -> bool:
    """Whether every edge of ``edges`` ((2, E) int) has its reverse in ``edges``."""
    forward = {(int(s), int(d)) for s, d in edges.T}
    return all((d, s) in forward for s, d in forward)


def _check_inputs(x: np.ndarray, train_edges: np.ndarray, pairs: dict[str, Pairs]) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be (N, F), got shape {x.shape}")
    if train_edges.ndim != 2 or train_edges.shape[0] != 2:
        raise ValueError(f"train_edges must be (2, E), got shape {train_edges.shape}")
    if train_edges.size and (train_edges.min() < 0 or train_edges.max() >= len(x)):
        raise ValueError("train_edges hold node positions outside [0, N)")
    for split in SPLITS:
        if split not in pairs:
            raise ValueError(f"pairs lacks the '{split}' split")
        src, dst, label = pairs[split]
        if not (len(src) == len(dst) == len(label)):
            raise ValueError(f"{split}: src, dst and label differ in length")
        if len(src) and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= len(x)):
            raise ValueError(f"{split}: pairs hold node positions outside [0, N)")
        if not np.isin(label, (0, 1)).all() or not (label == 1).any() or not (label == 0).any():
            raise ValueError(f"{split}: labels must be 0/1 with both present")


def train_plain_link(x: np.ndarray, train_edges: np.ndarray, pairs: dict[str, Pairs], *, seed: int,
                     epochs: int = 100, hidden: int = 128, out: int = 64, lr: float = 0.01,
                     normalize_features: bool = True, hits_k: int = 50,
                     val_edges_at_test: bool = True) -> LinkReferenceResult:
    """Train the example's GCN link predictor full batch and evaluate it after every epoch.

    ``x``: (N, F) float32 features as the data gives them (row-normalised here with PyG's
    ``T.NormalizeFeatures`` when ``normalize_features``). ``train_edges``: (2, E) int64 node
    positions, the training graph (both directions stored for an undirected graph); its edges,
    each undirected edge once, are the training positives. ``pairs``: "val" / "test" -> (src (P,),
    dst (P,), label (P,) 0/1), every pair scored. ``val_edges_at_test``: add the val positives to
    the graph the test pairs are scored on (the example's test graph). Returns the val and test
    metrics at the epoch with the best validation ROC-AUC (first best wins).
    """
    import torch_geometric.transforms as T
    from torch_geometric.data import Data
    from torch_geometric.utils import negative_sampling

    _check_inputs(x, train_edges, pairs)
    torch.manual_seed(seed)
    random.seed(seed)  # negative_sampling draws with Python's random.sample
    features = torch.as_tensor(np.asarray(x, np.float32))
    if normalize_features:
        features = T.NormalizeFeatures()(Data(x=features)).x
    num_nodes = features.shape[0]
    undirected = is_undirected(train_edges)
    graph = torch.as_tensor(np.asarray(train_edges, np.int64))
    # the training positives: each undirected edge once (src <= dst, as RandomLinkSplit keeps them)
    positives = graph[:, graph[0] <= graph[1]] if undirected else graph
    label_index = {s: torch.as_tensor(np.stack(pairs[s][:2]).astype(np.int64)) for s in SPLITS}
    labels = {s: np.asarray(pairs[s][2]) for s in SPLITS}
    graphs = {"val": graph, "test": graph}
    if val_edges_at_test:
        val_pos = label_index["val"][:, torch.as_tensor(labels["val"] == 1)]
        added = torch.cat([val_pos, val_pos.flip(0)], dim=1) if undirected else val_pos
        graphs["test"] = torch.cat([graph, added], dim=1)

    model = GCNLinkPredictor(features.shape[1], hidden, out)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    criterion = torch.nn.BCEWithLogitsLoss()
    best_val, best_epoch, metrics = -float("inf"), 0, {}
    started = time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        optimizer.zero_grad()
        z = model.encode(features, graph)
        negatives = negative_sampling(edge_index=graph, num_nodes=num_nodes,
                                      num_neg_samples=positives.shape[1], method="sparse")
        logits = model.decode(z, torch.cat([positives, negatives], dim=1))
        target = torch.cat([torch.ones(positives.shape[1]), torch.zeros(negatives.shape[1])])
        loss = criterion(logits, target)
        loss.backward()
        optimizer.step()

        model.eval()
        with torch.no_grad():
            scores = {s: model.decode(model.encode(features, graphs[s]), label_index[s]).double().numpy()
                      for s in SPLITS}
        val_auc = roc_auc(scores["val"], labels["val"])
        log.debug("epoch %03d loss %.4f val ROC-AUC %.4f", epoch, loss.item(), val_auc)
        if val_auc > best_val:
            best_val, best_epoch = val_auc, epoch
            metrics = {s: split_metrics(scores[s], labels[s], hits_k) for s in SPLITS}
    seconds = time.perf_counter() - started
    log.info("seed %d: best epoch %d of %d, val ROC-AUC %.4f, test ROC-AUC %.4f (%.1f s)", seed, best_epoch,
             epochs, metrics["val"]["roc_auc"], metrics["test"]["roc_auc"], seconds)
    return LinkReferenceResult(best_epoch=best_epoch, seconds=seconds, metrics=metrics)


def split_metrics(scores: np.ndarray, labels: np.ndarray, hits_k: int) -> dict[str, float]:
    """ROC-AUC, MRR and Hits@``hits_k`` of (P,) ``scores`` against (P,) 0/1 ``labels``: positives
    ranked among the negatives of the same split."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return {"roc_auc": roc_auc(scores, labels), "mrr": mean_reciprocal_rank(pos, neg),
            "hits_at_k": hits_at_k(pos, neg, hits_k)}


PLANETOID_NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
PLANETOID_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")


def load_planetoid(directory: str, name: str, root: str):  # -> torch_geometric.data.Data
    """The Planetoid dataset ``name`` (cora, citeseer, pubmed) read by PyG's own ``Planetoid``
    class from the raw files ``ind.<name>.*`` in ``directory``, copied to ``root/<Name>/raw``.
    PyG unpickles them unguarded, so each is first read with the project's allow-list unpickler."""
    import shutil
    from pathlib import Path

    from torch_geometric.datasets import Planetoid

    from graphstore.ingest.planetoid import safe_load

    raw = Path(root) / PLANETOID_NAMES[name] / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for part in PLANETOID_PARTS:
        source = Path(directory) / f"ind.{name}.{part}"
        if part != "test.index":
            safe_load(source)  # raises InputError on a class outside the allow-list
        shutil.copy(source, raw / source.name)
    return Planetoid(root, PLANETOID_NAMES[name])[0]


def example_split(data, seed: int) -> tuple[np.ndarray, dict[str, Pairs]]:
    """The example's ``RandomLinkSplit`` of ``data`` under ``seed`` as (train_edges (2, E),
    pairs); checks that the example's test graph is the training graph plus the val positives."""
    import torch_geometric.transforms as T

    torch.manual_seed(seed)
    random.seed(seed)  # RandomLinkSplit samples its val / test negatives with random.sample
    train, val, test = T.RandomLinkSplit(num_val=0.05, num_test=0.1, is_undirected=True,
                                         add_negative_train_samples=False)(data)
    train_edges = train.edge_index.numpy()
    pairs = {s: (d.edge_label_index[0].numpy(), d.edge_label_index[1].numpy(), d.edge_label.long().numpy())
             for s, d in (("val", val), ("test", test))}
    val_pos = val.edge_label_index[:, val.edge_label == 1]
    rebuilt = torch.cat([train.edge_index, val_pos, val_pos.flip(0)], dim=1)
    if sorted(map(tuple, rebuilt.T.tolist())) != sorted(map(tuple, test.edge_index.T.tolist())):
        raise AssertionError("RandomLinkSplit's test graph is not the training graph plus the val positives")
    return train_edges, pairs


if __name__ == "__main__":
    import argparse
    import statistics
    import tempfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description="PyG's examples/link_pred.py recipe on a Planetoid dataset "
                                                 "(one line per seed, then the mean).")
    parser.add_argument("--data", default=str(repo / ".." / "shared" / "datasets" / "cora"),
                        help="folder with the raw ind.<name>.* files (default: ../shared/datasets/cora "
                             "from the repository root)")
    parser.add_argument("--name", default="cora", choices=sorted(PLANETOID_NAMES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    hits_k = 50
    with tempfile.TemporaryDirectory() as root:
        data = load_planetoid(args.data, args.name, root)
    x = data.x.numpy()
    results = []
    for seed in range(args.seeds):
        train_edges, pairs = example_split(data, seed)
        result = train_plain_link(x, train_edges, pairs, seed=seed, epochs=args.epochs, hits_k=hits_k)
        results.append(result)
        line = ", ".join(f"{s} ROC-AUC {m['roc_auc']:.4f} MRR {m['mrr']:.4f} Hits@{hits_k} {m['hits_at_k']:.4f}"
                         for s, m in result.metrics.items())
        print(f"{args.name} seed {seed}: best epoch {result.best_epoch:3d}, {line} ({result.seconds:.1f} s)")
    means = {s: {k: statistics.mean(r.metrics[s][k] for r in results) for k in ("roc_auc", "mrr", "hits_at_k")}
             for s in SPLITS}
    line = ", ".join(f"{s} ROC-AUC {m['roc_auc']:.4f} MRR {m['mrr']:.4f} Hits@{hits_k} {m['hits_at_k']:.4f}"
                     for s, m in means.items())
    print(f"{args.name} mean of {args.seeds} seeds: {line} "
          f"({statistics.mean(r.seconds for r in results):.1f} s per seed)")
