"""Shared fixtures for the store / ingestion / partitioning tests.

Expensive artefacts (Cora and a 2000-node synthetic graph, partitioned with every method) are
built once per session in a session-scoped store; tests may add artefacts to it but never change
or remove one. Tests that check what a command writes get a fresh ``tmp_path`` store, or a copy
of a small template store that already holds a dataset (``store_with_dataset``).

The CLI is run as ``python -m cli`` (what the ``retexo`` console script calls) in a
subprocess with stdin closed, so exit codes and prompts are the real ones.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphstore.ingest.api import ingest_planetoid, ingest_synthetic, ingest_tables
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.synthetic import SyntheticOptions
from graphstore.ingest.tables import TableOptions
from graphstore.lookup import DatasetRef, PartitionRef
from graphstore.layout import Store
from graphstore.parquet_io import features_of
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from processes import REPO, run_together  # noqa: F401  (run_together: re-exported for the tests)

CORA_DIR = REPO / "data" / "cora"
RETEXO = [sys.executable, "-m", "cli"]
GRAPH_METHODS = ("random", "metis", "supernode")


# --------------------------------------------------------------------------- the test process


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker gets a Prefect home of its own in this test run's temporary folder
    (beside the worker's ``popen-gwN``), so that the temporary Prefect servers of ``retexo run``
    commands never share one SQLite database with another worker or with another test run in the
    same checkout. Set (and made: Prefect makes only the last folder of its home) before any test
    module imports Prefect.

    The worker's temporary files go there too (``TMPDIR``, which the processes it starts inherit):
    what a killed process could not remove (a launch's error folder after SIGKILL) and what
    libraries never remove (the modules PyG generates for its convs) then go with pytest's old run
    folders instead of piling up in the system's temporary folder."""
    worker, basetemp = os.environ.get("PYTEST_XDIST_WORKER"), config.option.basetemp
    if worker and basetemp:
        home = Path(basetemp).parent / f"prefect-home-{worker}"
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = str(home)
        scratch = Path(basetemp).parent / f"tmp-{worker}"
        scratch.mkdir(parents=True, exist_ok=True)
        os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In pytest-xdist workers, the ``slow`` tests first (otherwise in collection order): the
    workers take tests from the front of the queue, so the minutes-long process tests start
    while the many short ones are left to fill the gaps, instead of the alphabetically last
    ones (sites, torchrun, training runtime) running alone at the end. A plain run keeps the
    collection order (module-scoped fixtures are then made once per module)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def default_torch_threads() -> int:
    """Torch's number of intra-op threads before any test ran."""
    import torch

    return torch.get_num_threads()


@pytest.fixture(autouse=True)
def torch_threads_reset(default_torch_threads: int) -> Iterator[None]:
    """Every test starts with torch's default number of threads. ``torch.set_num_threads`` in any
    thread (the threads launcher calls it in each rank thread) also sets the number that every
    thread started later begins with, so ranks run as threads (``run_threads``) would otherwise use
    what an earlier test's launch set, and how a torch kernel splits a sum depends on it."""
    yield
    import torch

    torch.set_num_threads(default_torch_threads)


# --------------------------------------------------------------------------- Prefect


@contextmanager
def prefect_test_server() -> Iterator[None]:
    """Prefect's test harness (a temporary server over a temporary SQLite database) for the flows
    run in this process. Its server is given 300 s to start, and a first ``/health``
    answer slower than Prefect's 5 s is waited for (``cli.prefect_runtime.start_temporary_server``,
    as ``retexo run`` does): with make test's workers on both cores, Prefect's own start once
    raised ``httpx.ReadTimeout`` here."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.testing.utilities import prefect_test_harness

    from cli.prefect_runtime import start_temporary_server

    startup_s = 300
    prefect_start = SubprocessASGIServer.start

    def patient_start(server: SubprocessASGIServer, timeout: int | None = None) -> None:
        start_temporary_server(server, timeout or startup_s, prefect_start)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SubprocessASGIServer, "start", patient_start)
        with prefect_test_harness(server_startup_timeout=startup_s):
            yield


# --------------------------------------------------------------------------- CLI


def cli_env() -> dict[str, str]:
    """Environment for CLI subprocesses: wide terminal (no wrapped messages), no store override, and
    300 s for a temporary Prefect server to start (a bound on failure: the command's 120 s ran out
    once while make test's workers loaded both CPUs)."""
    env = {k: v for k, v in os.environ.items() if k != "RETEXO_STORE"}
    env.update(COLUMNS="400", LINES="50", NO_COLOR="1", TERM="dumb", PYTHONPATH=str(REPO))
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    return env


def run_cli(*args: object, store: Path | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``retexo`` CLI in a subprocess with stdin closed (nothing may prompt)."""
    command = [*RETEXO, *map(str, args)]
    if store is not None:
        command += ["--store", str(store)]
    return subprocess.run(
        command, cwd=REPO, env={**cli_env(), **(env or {})}, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=timeout,
    )


def flat(text: str) -> str:
    """Whitespace-normalised text, so assertions do not depend on line wrapping."""
    return re.sub(r"\s+", " ", text).strip()


def table_rows(stdout: str) -> list[list[str]]:
    """Data rows of a rich table printed by the CLI (cells stripped)."""
    return [
        [cell.strip() for cell in line.strip().strip("│").split("│")]
        for line in stdout.splitlines()
        if line.startswith("│")
    ]


# --------------------------------------------------------------------------- stored features


def dense_features(table: pa.Table | Path, width: int) -> np.ndarray:
    """A stored features table (or Parquet file) in either layout as a dense (N, width) float32
    array, so that tests compare values whatever the layout."""
    if isinstance(table, Path):
        table = pq.read_table(table)
    x = features_of(table, width)
    return x if isinstance(x, np.ndarray) else x.toarray()


def dataset_features(ref: DatasetRef) -> np.ndarray:
    """A dataset's features.parquet as a dense (N, F) float32 array."""
    return dense_features(ref.path / "features.parquet", ref.num_features)


# --------------------------------------------------------------------------- store snapshots


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and mtime (ns): 'unchanged' means equal."""
    found = {}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        found[str(path.relative_to(root))] = (stat.st_size if path.is_file() else -1, stat.st_mtime_ns)
    return found


# --------------------------------------------------------------------------- small graphs


@dataclass(frozen=True)
class TableFiles:
    """Paths of a small valid tables graph written by ``write_tables``."""

    edges: Path
    nodes: Path
    features: Path


def write_tables(folder: Path, num_nodes: int = 60, seed: int = 0, id_offset: int = 100) -> TableFiles:
    """A small valid graph as CSV files: sparse, non-contiguous node ids, 3 classes, a site column.

    Node ids are ``id_offset + 3 * i`` (not row positions), labels ``i % 3``, site ``a/b/c`` in
    blocks, features f0..f3; edges: a ring plus random chords, stored one way.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = id_offset + 3 * np.arange(num_nodes)
    ring = np.stack([ids, np.roll(ids, -1)], axis=1)
    chords = ids[rng.integers(0, num_nodes, (num_nodes, 2))]
    chords = chords[chords[:, 0] != chords[:, 1]]
    edges = np.concatenate([ring, chords])
    sites = np.array(["a", "b", "c"])[np.arange(num_nodes) * 3 // num_nodes]
    (folder / "edges.csv").write_text("src,dst\n" + "".join(f"{s},{d}\n" for s, d in edges))
    (folder / "nodes.csv").write_text(
        "node_id,label,site\n" + "".join(f"{n},{i % 3},{sites[i]}\n" for i, n in enumerate(ids))
    )
    x = rng.standard_normal((num_nodes, 4)).round(3)
    (folder / "features.csv").write_text(
        "node_id,f0,f1,f2,f3\n" + "".join(f"{n}," + ",".join(map(str, row)) + "\n" for n, row in zip(ids, x))
    )
    return TableFiles(folder / "edges.csv", folder / "nodes.csv", folder / "features.csv")


def write_table_version(folder: Path, version: int, num_nodes: int = 400, seed: int = 0) -> TableFiles:
    """Version 1 or 2 of a small learnable tables graph (the nightly export of a data team).

    Version 1: ``num_nodes`` nodes with ids ``10 + 7 * i``, 4 classes, homophilous edges (each node
    links to 4 random nodes of its class and 1 of any class), 8 features = class signal + noise, a
    ``site`` column s0..s2. Version 2 is version 1 plus 5 % new nodes (same rules; their edges
    reach old nodes too) and the features of every 10th old node redrawn. Same ``seed`` -> same files.
    """

    def links(rng: np.random.Generator, rows: range, label: np.ndarray) -> list[tuple[int, int]]:
        pairs = []
        for i in rows:
            pairs += [(i, int(j)) for j in rng.choice(np.flatnonzero(label == label[i]), 4)]
            pairs.append((i, int(rng.integers(0, len(label)))))
        return [(a, b) for a, b in pairs if a != b]

    folder.mkdir(parents=True, exist_ok=True)
    rng, extra = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    centers = rng.standard_normal((4, 8))
    label = rng.integers(0, 4, num_nodes)
    x = centers[label] * 0.8 + rng.standard_normal((num_nodes, 8))
    pairs = links(rng, range(num_nodes), label)
    if version >= 2:
        added = num_nodes // 20
        label = np.concatenate([label, extra.integers(0, 4, added)])
        x = np.concatenate([x, centers[label[num_nodes:]] * 0.8 + extra.standard_normal((added, 8))])
        x[:num_nodes:10] = centers[label[:num_nodes:10]] * 0.8 + extra.standard_normal((len(x[:num_nodes:10]), 8))
        pairs += links(extra, range(num_nodes, num_nodes + added), label)
    ids = 10 + 7 * np.arange(len(label))
    (folder / "edges.csv").write_text("src,dst\n" + "".join(f"{ids[a]},{ids[b]}\n" for a, b in pairs))
    (folder / "nodes.csv").write_text(
        "node_id,label,site\n" + "".join(f"{n},{label[i]},s{i % 3}\n" for i, n in enumerate(ids))
    )
    (folder / "features.csv").write_text(
        "node_id," + ",".join(f"f{k}" for k in range(8)) + "\n"
        + "".join(f"{n}," + ",".join(f"{v:.4f}" for v in row) + "\n" for n, row in zip(ids, x))
    )
    return TableFiles(folder / "edges.csv", folder / "nodes.csv", folder / "features.csv")


def ingest_table_files(store: Store, files: TableFiles, name: str = "tiny", undirected: bool = True) -> DatasetRef:
    return ingest_tables(
        store, name, files.edges, files.nodes, files.features, TableOptions(undirected=undirected), SplitFractions()
    )


# --------------------------------------------------------------------------- Planetoid file sets


def write_planetoid(
    folder: Path,
    prefix: str,
    allx: np.ndarray,
    ally: np.ndarray,
    num_train: int,
    tx: np.ndarray,
    ty: np.ndarray,
    test_index: list[int],
    graph: dict[int, list[int]],
    protocol: int = 2,
) -> Path:
    """Write the eight ``ind.<prefix>.*`` files the way the Planetoid data sets are stored.

    ``x``/``tx``/``allx`` as scipy CSR matrices, ``y``/``ty``/``ally`` as numpy arrays, ``graph`` as a
    ``defaultdict(list)``; ``tx`` rows belong to ``test_index`` in file order.
    """
    import collections

    import scipy.sparse as sp

    folder.mkdir(parents=True, exist_ok=True)
    objects = {
        "x": sp.csr_matrix(allx[:num_train]),
        "y": ally[:num_train],
        "allx": sp.csr_matrix(allx),
        "ally": ally,
        "tx": sp.csr_matrix(tx),
        "ty": ty,
        "graph": collections.defaultdict(list, graph),
    }
    for part, obj in objects.items():
        with open(folder / f"ind.{prefix}.{part}", "wb") as handle:
            pickle.dump(obj, handle, protocol=protocol)
    (folder / f"ind.{prefix}.test.index").write_text("".join(f"{i}\n" for i in test_index))
    return folder


# --------------------------------------------------------------------------- session stores


@dataclass(frozen=True)
class PartitionedGraph:
    """A dataset in the session store and its partitions, one per method."""

    store: Store
    dataset: DatasetRef
    partitions: dict[str, PartitionRef]


@pytest.fixture(scope="session")
def session_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store.open(tmp_path_factory.mktemp("session-store"))


@pytest.fixture(scope="session")
def cora(session_store: Store) -> PartitionedGraph:
    """Real Cora, partitioned into 4 with random, metis and supernode."""
    dataset = ingest_planetoid(session_store, CORA_DIR, "cora")
    partitions = {m: build_partition(session_store, dataset, PartitionOptions(method=m, parts=4, seed=0))
                  for m in GRAPH_METHODS}
    return PartitionedGraph(session_store, dataset, partitions)


@pytest.fixture(scope="session")
def synthetic_graph(session_store: Store) -> PartitionedGraph:
    """A 2000-node SBM (avg degree 10), partitioned into 5 with random, metis and supernode."""
    options = SyntheticOptions(nodes=2000, avg_degree=10, classes=4, features=8, seed=3)
    dataset = ingest_synthetic(session_store, "sbm", options, SplitFractions(seed=3))
    partitions = {m: build_partition(session_store, dataset, PartitionOptions(method=m, parts=5, seed=1))
                  for m in GRAPH_METHODS}
    return PartitionedGraph(session_store, dataset, partitions)


@pytest.fixture(scope="session")
def site_graph(session_store: Store, tmp_path_factory: pytest.TempPathFactory) -> PartitionedGraph:
    """The small tables graph (sparse ids, a ``site`` column a/b/c) partitioned by that column."""
    files = write_tables(tmp_path_factory.mktemp("site-tables"), num_nodes=90)
    dataset = ingest_table_files(session_store, files, name="sites")
    options = PartitionOptions(method="column", column="site", parts=3)
    return PartitionedGraph(session_store, dataset, {"column": build_partition(session_store, dataset, options)})


@pytest.fixture(scope="session")
def template_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding one small tables dataset (copied by ``store_with_dataset``)."""
    root = tmp_path_factory.mktemp("template-store")
    files = write_tables(tmp_path_factory.mktemp("template-tables"))
    store = Store.open(root)
    ingest_table_files(store, files, name="base")
    from graphstore.catalog import refresh_catalog

    refresh_catalog(store)
    return root


@pytest.fixture
def store_with_dataset(template_store: Path, tmp_path: Path) -> Iterator[Path]:
    """A private store that already has a dataset in it (mtimes preserved by the copy), its
    catalog written for its own path (a copied catalog names the template's: test_store_moves)."""
    from graphstore.catalog import refresh_catalog

    root = tmp_path / "store"
    shutil.copytree(template_store, root)
    refresh_catalog(Store.open(root))
    yield root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A 60-node synthetic graph in 3 random partitions, for the training tests."""
    from training_helpers import make_tiny

    return make_tiny(tmp_path_factory)

