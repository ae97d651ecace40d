"""Graphs stored as an adjacency matrix in a MATLAB ``.mat`` file: the structure-only link-prediction
benchmarks of SEAL and WLNM (USAir, NS, PB, Yeast, Celegans, Power, Router, Ecoli; ``net`` in
each file), and any graph a MATLAB user saves the same way.

``scipy.io.loadmat`` reads MATLAB v4 to v7.2 files (v7.3 is HDF5 and refused with one line); it
unpickles nothing. The graph is the N x N matrix under ``key``, or the file's only 2-D matrix.
Node ids are the rows 0..N-1 and edges the non-zero entries off the diagonal (values ignored; the
GNNs add their own self loops). A symmetric matrix is an undirected graph (each edge stored both
ways), any other a directed one. Such files hold no
features and no labels: node i gets the one-hot feature i, stored sparse (as ``ingest tables
--missing-features identity``: the first layer learns an embedding per node), and every label is
unknown (-1), so the dataset serves the link task (``retexo ingest link-split``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse

from graphstore.errors import InputError
from graphstore.ingest.graph import SourceGraph


def adjacency_of(path: Path, key: str | None) -> scipy.sparse.csr_matrix:
    """(N, N) adjacency of ``path`` under ``key`` (default: its only 2-D matrix); ``InputError``
    naming the file and what was expected otherwise."""
    if not path.is_file():
        raise InputError(str(path), "file does not exist")
    try:
        arrays = {k: v for k, v in scipy.io.loadmat(path).items() if not k.startswith("__")}
    except NotImplementedError:
        raise InputError(str(path), "a MATLAB v7.3 (HDF5) file; save it with -v7 or earlier") from None
    except (scipy.io.matlab.MatReadError, ValueError, TypeError, OSError, EOFError) as error:
        raise InputError(str(path), f"not a MATLAB .mat file ({error})") from None
    matrices = sorted(k for k, v in arrays.items() if getattr(v, "ndim", 0) == 2 and min(v.shape) > 1)
    if key is None:
        if len(matrices) != 1:
            raise InputError(str(path), f"expected one adjacency matrix, found {matrices or 'none'}: pass --key")
        key = matrices[0]
    if key not in arrays:
        raise InputError(str(path), f"no variable '{key}' (the file holds {', '.join(sorted(arrays)) or 'none'})")
    matrix = arrays[key]
    if getattr(matrix, "ndim", 0) != 2 or matrix.shape[0] != matrix.shape[1]:
        raise InputError(f"{path}: {key}", f"expected a square N x N adjacency matrix, got shape "
                                           f"{getattr(matrix, 'shape', type(matrix).__name__)}")
    try:
        return scipy.sparse.csr_matrix(matrix, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise InputError(f"{path}: {key}", f"expected a numeric matrix ({error})") from None


def load_mat(path: Path, key: str | None) -> SourceGraph:
    """The graph of ``path``: identity features, unknown labels, undirected when symmetric."""
    adjacency = adjacency_of(path, key)
    adjacency.setdiag(0)
    adjacency.eliminate_zeros()
    n = adjacency.shape[0]
    undirected = (adjacency != adjacency.T).nnz == 0
    kept = scipy.sparse.triu(adjacency).tocoo() if undirected else adjacency.tocoo()  # each undirected edge once
    src, dst = kept.row.astype(np.int64), kept.col.astype(np.int64)
    return SourceGraph(node_id=np.arange(n, dtype=np.int64), label=np.full(n, -1, dtype=np.int64), split=None,
                       x=scipy.sparse.identity(n, dtype=np.float32, format="csr"), src=src, dst=dst,
                       num_classes=0, undirected=undirected, files={"edges": str(path), "nodes": str(path)})
