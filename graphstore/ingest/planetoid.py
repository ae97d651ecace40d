"""Planetoid raw format (Cora, CiteSeer, PubMed): ``ind.<prefix>.{x,y,tx,ty,allx,ally,graph,test.index}``.

The pickles were written by Python 2 and are read only through an allow-list unpickler: a file
whose pickle asks for any other class is refused. The split is the public one (train = the
rows of ``y``, val = the next 500, test = ``test.index``); CiteSeer's test indices that have no
feature row are padded with zero features and an unknown label, as the reference GCN loader does.

The features (``allx``, ``tx``: scipy CSR bag-of-words matrices) stay sparse all the way: the
padding and the test-row reordering are row selections of CSR matrices, so no N x F array is
built (a pickle holding a dense ndarray instead gives a dense matrix).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from graphstore.errors import InputError
from graphstore.fingerprint import file_digest
from graphstore.ingest.graph import SourceGraph

if TYPE_CHECKING:
    from graphstore.parquet_io import FeatureMatrix

PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")

# (module, name) pairs the Planetoid pickles may construct, mapped to today's module names.
_ALLOWED: dict[tuple[str, str], tuple[str, str]] = {
    ("numpy", "ndarray"): ("numpy", "ndarray"),
    ("numpy", "dtype"): ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("scipy.sparse.csr", "csr_matrix"): ("scipy.sparse", "csr_matrix"),
    ("scipy.sparse._csr", "csr_matrix"): ("scipy.sparse", "csr_matrix"),
    ("collections", "defaultdict"): ("collections", "defaultdict"),
    ("__builtin__", "list"): ("builtins", "list"),
    # bytes in protocol-2 pickles written by Python 3 (files re-saved from Python 3): str -> bytes only
    ("_codecs", "encode"): ("_codecs", "encode"),
    ("builtins", "list"): ("builtins", "list"),
}


class AllowListUnpickler(pickle.Unpickler):
    """Unpickler that constructs only the numpy/scipy/collections classes the format needs."""

    def __init__(self, data: bytes, file: str):
        super().__init__(io.BytesIO(data), encoding="latin1")
        self.file = file

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _ALLOWED:
            raise InputError(
                self.file,
                f"pickle asks to construct '{module}.{name}', which is not allowed in a Planetoid file "
                "(only numpy arrays, scipy CSR matrices and adjacency dicts are)",
            )
        return super().find_class(*_ALLOWED[(module, name)])


def safe_load(path: Path) -> object:
    try:
        return AllowListUnpickler(path.read_bytes(), str(path)).load()
    except InputError:
        raise
    except Exception as exc:  # truncated or foreign file
        raise InputError(str(path), f"not a readable Planetoid pickle ({type(exc).__name__}: {exc})") from exc


def find_prefix(directory: Path) -> str:
    """The ``<prefix>`` of the ``ind.<prefix>.*`` files in ``directory`` (exactly one set expected)."""
    if not directory.is_dir():
        raise InputError(str(directory), "is not a directory with Planetoid files")
    prefixes = sorted({p.name.split(".")[1] for p in directory.glob("ind.*.graph")})
    if len(prefixes) != 1:
        raise InputError(
            str(directory),
            f"expected exactly one set of ind.<name>.graph files, found {prefixes or 'none'}",
        )
    prefix = prefixes[0]
    missing = [part for part in PARTS if not (directory / f"ind.{prefix}.{part}").is_file()]
    if missing:
        raise InputError(str(directory), f"Planetoid set '{prefix}' is missing files: {', '.join(missing)}")
    return prefix


def planetoid_content(directory: Path) -> dict[str, str]:
    """sha256 of each of the eight files (the dataset fingerprint's content part)."""
    prefix = find_prefix(directory)
    return {part: file_digest(directory / f"ind.{prefix}.{part}") for part in PARTS}


def _dense(matrix: object, path: Path) -> np.ndarray:
    """A small matrix (the one-hot labels) as a float32 ndarray."""
    import scipy.sparse as sp  # imported here: it adds ~0.15 s to every CLI start

    if sp.issparse(matrix):
        return np.asarray(matrix.todense(), dtype=np.float32)
    if isinstance(matrix, np.ndarray):
        return matrix.astype(np.float32)
    raise InputError(str(path), f"expected a matrix, found {type(matrix).__name__}")


def _features(matrix: object, path: Path) -> "FeatureMatrix":
    """A feature matrix as it is in the file: float32 CSR for a scipy matrix, else a dense ndarray."""
    import scipy.sparse as sp

    if sp.issparse(matrix):
        return sp.csr_matrix(matrix, dtype=np.float32)
    if isinstance(matrix, np.ndarray) and matrix.ndim == 2:
        return matrix.astype(np.float32)
    raise InputError(str(path), f"expected a matrix, found {type(matrix).__name__}")


def _take_rows(x: "FeatureMatrix", rows: np.ndarray) -> "FeatureMatrix":
    """Rows ``rows`` of ``x``; a row index of -1 gives a row of zeros (dense or CSR alike)."""
    import scipy.sparse as sp

    padded = sp.vstack([x, sp.csr_matrix((1, x.shape[1]), dtype=np.float32)], format="csr") if sp.issparse(x) \
        else np.vstack([x, np.zeros((1, x.shape[1]), np.float32)])
    return padded[np.where(rows < 0, x.shape[0], rows)]


def _stack(top: "FeatureMatrix", bottom: "FeatureMatrix") -> "FeatureMatrix":
    import scipy.sparse as sp

    if sp.issparse(top) or sp.issparse(bottom):
        return sp.vstack([sp.csr_matrix(top), sp.csr_matrix(bottom)], format="csr", dtype=np.float32)
    return np.vstack([top, bottom])


def load_planetoid(directory: Path) -> SourceGraph:
    """Read the eight files; node ids are 0..N-1 in the reference loader's order."""
    prefix = find_prefix(directory)
    path = {part: directory / f"ind.{prefix}.{part}" for part in PARTS}
    # every file is read and checked, in the reference loader's order (``x`` itself is not used:
    # its rows are the first rows of ``allx``)
    loaded = {p: safe_load(path[p]) for p in ("x", "y", "tx", "ty", "allx", "ally")}
    _x, tx, allx = (_features(loaded[p], path[p]) for p in ("x", "tx", "allx"))
    y, ty, ally = (_dense(loaded[p], path[p]) for p in ("y", "ty", "ally"))
    graph = safe_load(path["graph"])
    if not isinstance(graph, dict):
        raise InputError(str(path["graph"]), f"expected a dict of adjacency lists, found {type(graph).__name__}")
    try:
        test_index = np.array([int(line) for line in path["test.index"].read_text().split()], dtype=np.int64)
    except ValueError as exc:
        raise InputError(str(path["test.index"]), f"expected one integer per line ({exc})") from exc
    test_sorted = np.sort(test_index)

    # Test indices without a feature row (CiteSeer): pad with zero features, unknown label.
    # Row k of tx/ty goes to position test_sorted[k] - min of the full test range, others are -1.
    full_range = np.arange(test_sorted.min(), test_sorted.max() + 1)
    source_row = np.full(len(full_range), -1, np.int64)
    source_row[test_sorted - test_sorted.min()] = np.arange(len(test_sorted))
    tx_full = _take_rows(tx, source_row)
    ty_full = np.zeros((len(full_range), ty.shape[1]), np.float32)
    ty_full[test_sorted - test_sorted.min()] = ty

    features = _stack(allx, tx_full)
    onehot = np.vstack([ally, ty_full])
    # The reference loader's ``features[test_index] = features[test_sorted]``, as a row permutation.
    num_nodes = features.shape[0]
    permutation = np.arange(num_nodes)
    permutation[test_index] = test_sorted
    features = features[permutation]
    onehot = onehot[permutation]
    label = np.where(onehot.sum(1) > 0, onehot.argmax(1), -1).astype(np.int64)

    split = np.full(num_nodes, "none", dtype="<U5")
    split[np.arange(y.shape[0])] = "train"
    split[np.arange(y.shape[0], min(y.shape[0] + 500, num_nodes))] = "val"  # small sets: clipped
    split[test_sorted] = "test"
    split[label < 0] = "none"

    src = np.fromiter((u for u, nbrs in graph.items() for _ in nbrs), dtype=np.int64)
    dst = np.fromiter((v for nbrs in graph.values() for v in nbrs), dtype=np.int64)
    # The adjacency dict is an undirected graph: store every edge both ways.
    src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    return SourceGraph(
        node_id=np.arange(num_nodes, dtype=np.int64),
        label=label,
        split=split,
        x=features,
        src=src,
        dst=dst,
        num_classes=int(onehot.shape[1]),
        files={"nodes": str(path["ally"]), "features": str(path["allx"]), "edges": str(path["graph"])},
    )
