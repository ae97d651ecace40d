"""``benchmarks/accuracy.py --graph``: the suite's comparison on a graph of one's own, from an ``.npz``
(its official splits, one per seed) or from a dataset already in the store, cut as asked, and one-line
errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.app import app
from graphstore.layout import Store
from processes import REPO
from test_ingest_npz import gnn_benchmark, heterophilous, write_npz

SCRIPT = REPO / "benchmarks" / "accuracy.py"


def accuracy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=900)


def ingest_ring_tables(store: Path, folder: Path, n: int = 48) -> None:
    """A ring of ``n`` nodes with chords, three classes by position, a train/val/test column, one-hot
    features of the class plus noise; ingested by ``retexo ingest tables`` as ``ring``."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    edges = [(i, (i + 1) % n) for i in range(n)] + [(i, (i + 3) % n) for i in range(0, n, 4)]
    (folder / "edges.csv").write_text("src,dst\n" + "".join(f"{a},{b}\n" for a, b in edges))
    split = ["train", "train", "val", "test"]
    (folder / "nodes.csv").write_text("node_id,label,split\n" + "".join(
        f"{i},{i * 3 // n},{split[i % 4]}\n" for i in range(n)))
    features = np.eye(3)[np.arange(n) * 3 // n] + rng.random((n, 3))
    (folder / "features.csv").write_text("node_id,f0,f1,f2\n" + "".join(
        f"{i}," + ",".join(f"{v:.3f}" for v in row) + "\n" for i, row in enumerate(features)))
    result = CliRunner().invoke(app, ["ingest", "tables", "--edges", str(folder / "edges.csv"), "--nodes",
                                      str(folder / "nodes.csv"), "--features", str(folder / "features.csv"),
                                      "--undirected", "--name", "ring", "--store", str(store)])
    assert result.exit_code == 0, result.output


def test_own_graphs_train_every_variant_per_split_or_seed_and_print_the_checks(tmp_path: Path):
    store = tmp_path / "store"
    ingest_ring_tables(store, tmp_path / "tables")
    split = write_npz(tmp_path / "two_splits.npz", heterophilous(n=60, splits=2))
    drawn = write_npz(tmp_path / "no_split.npz", gnn_benchmark(n=60))
    out = tmp_path / "rows.json"
    result = accuracy("--graph", f"mine={split}", "--graph", str(drawn), "--graph", "ring", "--models", "gcn",
                      "--variants", "reference,centralized", "--seeds", "3", "--partition", "metis", "--parts", "2",
                      "--jobs", "2", "--store", str(store), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert {(r["graph"], r["variant"]) for r in rows} == {(g, v) for g in ("mine", "no_split", "ring")
                                                          for v in ("reference", "centralized")}
    seeds = {r["graph"]: r["seeds"] for r in rows}
    assert seeds == {"mine": 2, "no_split": 3, "ring": 3}  # an .npz's official splits cap its seeds
    assert all(len(r["test"]) == r["seeds"] and all(0 <= t <= 1 for t in r["test"]) for r in rows)
    # one dataset per official split; the drawn split and the stored dataset are ingested once
    stored = sorted(p.parent.name for p in Store.open(store).datasets_dir().glob("name=*/fp=*"))
    assert stored == ["name=mine", "name=mine_split1", "name=no_split", "name=ring"]
    for graph in ("mine", "no_split", "ring"):
        assert f"| {graph} | gcn | centralized − reference " in result.stdout
    # one progress line per trained seed, with the figures the rows keep, and each job's summary line
    for row in rows:
        assert f"\n  {row['graph']} gcn {row['variant']}: val " in result.stdout, result.stdout
        for seed, (val, test) in enumerate(zip(row["val"], row["test"])):
            assert (f"    {row['graph']} gcn {row['variant']} seed {seed}: val {val:.4f} test {test:.4f} "
                    in result.stdout), result.stdout
    partitions = [json.loads(m.read_text()) for m in (store / "partitions").glob("*/*/manifest.json")]
    assert len(partitions) == 4 and all((m["method"], m["parts"]) == ("metis", 2) for m in partitions)


def test_a_partition_the_dataset_cannot_have_is_one_line_and_exit_code_2(tmp_path: Path):
    store = tmp_path / "store"
    ingest_ring_tables(store, tmp_path / "tables")
    result = accuracy("--store", str(store), "--graph", "ring", "--partition", "column", "--partition-column", "site")
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: dataset ring has no node column 'site' (columns: node_id, label, split)"), result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--graph", "nowhere/graph.npz"], "nowhere/graph.npz: --graph: no such file or folder"),
    (["--graph", "unknown_name"], "unknown_name: --graph: no such file or folder, and no dataset of that name in"),
    (["--graph", "x=README.md"], "README.md: --graph: expected a Planetoid folder, an .npz file or a .zip holding one"),
    (["--graph", str(REPO / "data" / "cora")], "'cora' is a suite graph's name; give yours another (NAME=PATH)"),
    (["--graphs", "cora,nope"], "--graphs: unknown nope; expected some of: cora, citeseer"),
    (["--partition", "column"], "--partition column and --partition-column COLUMN go together"),
    (["--parts", "0"], "--parts 0: Input should be greater than or equal to 1"),
])
def test_a_bad_graph_is_one_line_and_exit_code_2(args: list[str], message: str):
    result = accuracy(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
