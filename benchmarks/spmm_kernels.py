"""The CPU's sparse x dense product: a weighted ``embedding_bag`` sum (what ``retexo_core.sparse``
runs) against torch's CSR product (what it ran before), measured in one run.

Two parts:

1. The kernel alone, forward (A @ X) and backward (A^T @ G, the gradient to X), on random CSR
   matrices of the shapes the suite trains: a first layer's sparse bag-of-words inputs times its
   weight (Cora-like 2,708 x 1,433 at 1.3 % density; coauthor_cs-like aggregated inputs of one of 4
   parts, 4,584 x 6,805 at 1 % and 4 %; 20,000 x 2,000 at 10 %, the density up to which ingest stores
   a dense table sparse) and an aggregation over a part's adjacency (4,584 targets,
   15,174 sources, 9 entries per row, 256 columns), and a 100,000-node adjacency (10 per row). The
   feature products multiply by a weight's transpose, as the layers do (rows of X not contiguous).
2. One whole run: ``retexo train`` on Cora (4 random parts, GCN, ``--recipe default``, ranks as
   threads) with each kernel, each in a store of its own, and their test accuracy and validation.

Milliseconds per product (best of ``--repeats``), the ratio CSR / embedding_bag, and the largest
absolute difference between the two results (float32 sums in another order).

    .venv/bin/python benchmarks/spmm_kernels.py [--repeats 5] [--threads 1] [--skip-run]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import common  # puts the repository on the path
from graphstore.layout import Store  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from accuracy import train_once  # noqa: E402
from retexo_core import sparse  # noqa: E402

SHAPES = [  # name, rows, columns, entries per row, columns of X
    ("features, Cora-like", 2708, 1433, 18, 256),
    ("features, coauthor_cs-like part, 1 %", 4584, 6805, 68, 256),
    ("features, coauthor_cs-like part, 4 %", 4584, 6805, 272, 256),
    ("features at the ingest threshold, 10 %", 20_000, 2000, 200, 256),
    ("adjacency of a part", 4584, 15174, 9, 256),
    ("adjacency, 100,000 nodes", 100_000, 100_000, 10, 128),
]


def csr_product(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, shape: tuple[int, int],
                x: torch.Tensor) -> torch.Tensor:
    """The product as torch's CSR kernel computes it (the code before ``embedding_bag``)."""
    return sparse._csr_tensor(crow, col, val, shape, x.dtype) @ x


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def random_matrix(rows: int, cols: int, per_row: int, gen: torch.Generator) -> sparse.SparseMatrix:
    nnz = rows * per_row  # before duplicates are summed
    row, col = torch.randint(0, rows, (nnz,), generator=gen), torch.randint(0, cols, (nnz,), generator=gen)
    return sparse.SparseMatrix.from_coo(row, col, torch.rand(nnz, generator=gen), (rows, cols))


def kernel_rows(repeats: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    lines = ["| product | rows x columns, entries | X columns | forward CSR / embedding_bag ms | ratio "
             "| backward CSR / embedding_bag ms | ratio | max difference |", "|---|---|---|---|---|---|---|---|"]
    for name, rows, cols, per_row, d in SHAPES:
        a = random_matrix(rows, cols, per_row, gen)
        g = torch.randn(rows, d, generator=gen)
        # a first layer multiplies by its weight's transpose, (d, cols).t(): rows not contiguous
        features = name.startswith("features")
        x = torch.randn(d, cols, generator=gen).t() if features else torch.randn(cols, d, generator=gen)
        t_val = a.val.index_select(0, a.t_perm)
        t_shape = (cols, rows)
        timed = {}
        for kernel_name, kernel in (("csr", csr_product), ("bag", sparse._product)):
            timed[kernel_name] = (best_ms(lambda k=kernel: k(a.crow, a.col, a.val, a.shape, x), repeats),
                                  best_ms(lambda k=kernel: k(a.t_crow, a.t_col, t_val, t_shape, g), repeats))
        diff = (csr_product(a.crow, a.col, a.val, a.shape, x) - sparse._product(a.crow, a.col, a.val, a.shape, x))
        (f_csr, b_csr), (f_bag, b_bag) = timed["csr"], timed["bag"]
        lines.append(f"| {name} | {rows:,} x {cols:,}, {a.nnz:,} | {d} | {f_csr:.1f} / {f_bag:.1f} "
                     f"| {f_csr / f_bag:.1f} | {b_csr:.1f} / {b_bag:.1f} | {b_csr / b_bag:.1f} "
                     f"| {diff.abs().max().item():.1e} |")
        print(lines[-1], flush=True)
    return lines


@contextmanager
def kernel(product: Callable[..., torch.Tensor]) -> Iterator[None]:
    saved = sparse._product
    sparse._product = product
    try:
        yield
    finally:
        sparse._product = saved


def cora_run(folder: Path) -> tuple[float, float, float]:
    """(seconds, validation, test) of one retexo GCN run on Cora in a new store under ``folder``."""
    store = Store.open(folder)
    dataset = common.cora(store)
    partition = build_partition(store, dataset, PartitionOptions(method="random", parts=4, seed=0))
    started = time.perf_counter()
    run = train_once(store, dataset, partition, {"strategy": "retexo", "recipe": "default"}, "gcn", 0)
    return time.perf_counter() - started, run["val"], run["test"]


def run_rows() -> list[str]:
    lines = ["| kernel | seconds | validation | test |", "|---|---|---|---|"]
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, product in (("torch CSR", csr_product), ("embedding_bag", sparse._product)):
            with kernel(product):
                seconds[name], val, test = cora_run(Path(tmp) / name.replace(" ", "_"))
            lines.append(f"| {name} | {seconds[name]:.1f} | {val:.4f} | {test:.4f} |")
            print(lines[-1], flush=True)
    ratio = seconds["torch CSR"] / seconds["embedding_bag"]
    lines.append(f"\nretexo GCN on Cora, whole run: CSR / embedding_bag = {ratio:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the suite runs one per process)")
    parser.add_argument("--skip-run", action="store_true", help="the kernels only, not the whole Cora run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)\n")
    lines = kernel_rows(args.repeats)
    if not args.skip_run:
        print()
        lines += [""] + run_rows()
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
