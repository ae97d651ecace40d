"""Choosing how a feature matrix is stored: dense (``x``) or sparse (``x_idx``, ``x_val``).

The rule (``feature_format`` of the ingest options, default ``auto``):

- ``dense`` / ``sparse``: as declared (a sparse source is densified only when ``dense`` is asked for).
- ``auto``: a matrix that arrives sparse (the Planetoid pickles' scipy CSR matrices, the JSON
  lists of active feature ids) stays sparse: its producer already chose a sparse encoding, and
  densifying it could need N x F memory for a bag-of-words vocabulary of any width. A matrix that
  arrives dense (CSV/Parquet tables, OGB) is stored sparse when its density, non-zeros / (N x F),
  is at most ``SPARSE_DENSITY`` = 0.1.

Why 0.1: a sparse row costs 8 bytes per stored entry (int32 column id + float32 value) against
4 bytes per cell dense, on disk, in worker memory and on the wire, so at density 0.1 sparse takes
at most a fifth of the dense bytes; and sparse x dense products are slower per stored entry than
dense GEMM: on this project's 2-core CPU, with torch's CSR kernel, a 20,000 x 2,000 features @
2,000 x 256 weight product ran 0.7x the dense time at density 0.1 but 1.1x at 0.2 and 3.5x at 0.5
(the CPU's product is now an ``embedding_bag`` sum, 2.2 times faster than that kernel at density
0.1, forward, and 4.9 times backward: ``benchmarks/spmm_kernels.py``). At 0.1 or below sparse is
therefore smaller everywhere and not slower; above, the compute cost grows faster than the bytes
saved.

Synthetic graphs have Gaussian features (density 1) and are always dense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from graphstore.errors import InputError

if TYPE_CHECKING:
    from graphstore.parquet_io import FeatureMatrix

SPARSE_DENSITY = 0.1
RequestedFormat = Literal["auto", "dense", "sparse"]
REQUESTED_FORMAT_HELP = ("How features are stored: sparse (column ids + values per row) or dense; auto keeps sparse "
                         "sources (Planetoid, JSON) sparse and stores a dense table sparse at density <= 0.1.")


def density(x: "FeatureMatrix") -> float:
    """Non-zeros / (N x F) of an (N, F) ndarray or CSR matrix (explicit zeros not counted); 0 if empty."""
    cells = x.shape[0] * x.shape[1]
    if not cells:
        return 0.0
    nonzero = np.count_nonzero(x) if isinstance(x, np.ndarray) else int(np.count_nonzero(x.data))
    return nonzero / cells


def stored_format(x: "FeatureMatrix", requested: RequestedFormat) -> Literal["dense", "sparse"]:
    """The layout ``x`` is written in, by the rule of this module's docstring."""
    if requested not in ("auto", "dense", "sparse"):
        raise InputError("--feature-format", f"'{requested}' is not one of auto, dense, sparse")
    if requested != "auto":
        return requested
    if not isinstance(x, np.ndarray):
        return "sparse"
    return "sparse" if density(x) <= SPARSE_DENSITY else "dense"


def as_stored(x: "FeatureMatrix", requested: RequestedFormat) -> "FeatureMatrix":
    """``x`` converted to the layout it is written in: an (N, F) float32 ndarray, or a float32
    ``scipy.sparse.csr_matrix`` without explicit zeros, sorted column ids, no duplicates."""
    import scipy.sparse as sp  # imported here: it adds ~0.15 s to every CLI start

    if stored_format(x, requested) == "dense":
        return np.asarray(x.toarray() if sp.issparse(x) else x, dtype=np.float32)
    csr = sp.csr_matrix(x, dtype=np.float32, copy=True)  # never changes the caller's matrix
    csr.eliminate_zeros()
    csr.sum_duplicates()
    return csr
