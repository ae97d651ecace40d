"""Limits checked before work starts: names, seeds, int64 ids, parts <= nodes, and memory estimates
of ingest, partitioning and training against the memory available (override: --force).

Each refusal goes through the real CLI: exit code 2, one line on stderr that names the option or
file, no traceback, and nothing written to the store. Oversized requests run under an address-space
limit far below what they would need, so a refusal that came after an allocation would show as a
``MemoryError`` instead of the message.
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
from pathlib import Path

import pytest

from conftest import RETEXO, REPO, cli_env, flat, run_cli, snapshot, write_tables
from graphstore.limits import (CUDA_CONTEXT, Estimate, ResourceError, TrainingSizes, check_memory, gpu_estimate,
                               partition_estimate, synthetic_estimate, training_estimate)

ADDRESS_SPACE_LIMIT = 3 * 2**30  # bytes: far below any refused request, enough for the CLI itself


def refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one-line message of a refusal (exit code 2, no traceback), checked for ``words``."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def run_limited(*args: object, store: Path, limit_bytes: int = ADDRESS_SPACE_LIMIT) -> subprocess.CompletedProcess[str]:
    """The real CLI under an address-space limit of ``limit_bytes``."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([*RETEXO, *map(str, args), "--store", str(store)], cwd=REPO, env=cli_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, preexec_fn=limit)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("nodes", [500_000_000, 5_000_000_000])
def test_an_oversized_synthetic_graph_is_refused_before_any_allocation(tmp_path: Path, nodes: int) -> None:
    store = tmp_path / "store"
    result = run_limited("ingest", "synthetic", "--name", "huge", "--nodes", nodes, "--avg-degree", 10, store=store)
    refused(result, f"generating {nodes:,} nodes", "needs about", "is available", "--force")
    assert not (store / "datasets").exists()


def test_running_out_of_memory_after_the_estimate_is_one_line_and_leaves_no_dataset(tmp_path: Path) -> None:
    """50M nodes fit the estimate on a 24 GB machine (about 15 GB), not the 1.5 GB address space of the test."""
    store = tmp_path / "store"
    result = run_limited("ingest", "synthetic", "--name", "big", "--nodes", 50_000_000, "--avg-degree", 10,
                         "--force", store=store, limit_bytes=3 * 2**29)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]  # after the generator's progress lines
    assert last.startswith("error: out of memory") and "nothing half-written" in last, last
    assert not list(store.glob("datasets/name=big/fp=*/manifest.json"))


def wide_features_store(tmp_path: Path) -> Path:
    """A store with dataset ``wide``: 60 nodes whose 92-byte sparse feature file names feature 1e8."""
    files = write_tables(tmp_path / "input", num_nodes=60)
    ids = [int(line.split(",")[0]) for line in files.nodes.read_text().splitlines()[1:]]
    features = tmp_path / "features.json"
    features.write_text(json.dumps({str(i): [0, 100_000_000] if i == ids[0] else [1] for i in ids}))
    store = tmp_path / "store"
    ingested = run_cli("ingest", "tables", "--name", "wide", "--edges", files.edges, "--nodes", files.nodes,
                       "--features", features, store=store)
    assert ingested.returncode == 0, ingested.stderr
    return store


def test_a_92_byte_feature_file_naming_feature_1e8_cannot_start_a_training(tmp_path: Path) -> None:
    """The features ingest fine (they are stored sparse); a first layer of 1e8 x 256 weights is refused."""
    store = wide_features_store(tmp_path)
    before = snapshot(store)
    result = run_limited("train", "wide", "--parts", 2, "--partition-method", "random", store=store)
    refused(result, "100,000,001 input features", "needs about", "--force")
    assert not (store / "runs").exists()
    def data(files: dict) -> dict:  # the partition (and its lock file) may be built before the check
        return {k: v for k, v in files.items() if not k.startswith(("partitions", ".locks"))}

    assert data(snapshot(store)) == data(before)


def test_a_dry_run_prints_the_plan_and_the_estimates_and_writes_nothing(store_with_dataset: Path) -> None:
    before = snapshot(store_with_dataset)
    result = run_cli("train", "base", "--parts", 2, "--partition-method", "random", "--dry-run",
                     store=store_with_dataset)
    assert result.returncode == 0, result.stderr
    text = flat(result.stdout)
    for words in ("to be built: random into 2 parts", "partitioning 60 nodes", "training with 2 worker process(es)",
                  "fits"):
        assert words in text, text
    assert snapshot(store_with_dataset) == before  # no partition, no run, no lock file
    assert run_cli("partition", "base", "--parts", 2, "--method", "random", store=store_with_dataset).returncode == 0
    result = run_cli("train", "base", "--parts", 2, "--partition-method", "random", "--dry-run",
                     store=store_with_dataset)
    text = flat(result.stdout)
    assert "(stored)" in text and "layer 1 │ pending" in text and "layer 2 │ pending" in text, text
    assert "partitioning" not in text


def test_a_dry_run_that_would_not_fit_exits_2_and_names_the_estimate(tmp_path: Path) -> None:
    store = wide_features_store(tmp_path)
    before = snapshot(store)
    result = run_cli("train", "wide", "--strategy", "centralized", "--dry-run", store=store)
    assert result.returncode == 2, result.stderr
    assert "100,000,001 input features" in flat(result.stdout) and "would be refused" in flat(result.stdout)
    assert snapshot(store) == before


# benchmarks/scale.py on synthetic graphs (average degree 20, 64 dense features, METIS into 8 parts,
# retexo GCN and SAGE with hidden 256): nodes -> (halo rows of the partition, measured peak RSS of
# the whole process tree in bytes: ingest, partition, train gcn, train sage); docs/scale.md
SCALE_MEASURED = {
    100_000: (601_555, 0.35e9, 0.56e9, 5.75e9, 5.80e9),
    300_000: (1_804_234, 0.49e9, 1.15e9, 7.50e9, 8.46e9),
    1_000_000: (6_014_913, 0.79e9, 3.66e9, 14.98e9, 15.64e9),
}


@pytest.mark.parametrize("nodes", sorted(SCALE_MEASURED))
def test_the_estimates_are_within_10_percent_below_and_30_above_the_measured_peaks(nodes: int) -> None:
    halo, ingest, partition, *trainings = SCALE_MEASURED[nodes]
    edges = 20 * nodes
    ratios = [synthetic_estimate(nodes, 20, 64, 100_000).bytes / ingest,
              partition_estimate(nodes, edges, 8).bytes / partition]
    training = training_estimate(TrainingSizes(nodes=nodes, edges=edges, features=64, feature_bytes=nodes * 64 * 4,
                                               sparse=False, hidden=256, layers=2, workers=8, halo_nodes=halo)).bytes
    ratios += [training / peak for peak in trainings]
    assert all(0.9 <= r <= 1.3 for r in ratios), ratios


def test_force_turns_the_refusal_into_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    estimate = Estimate("something", 10 * 2**30, "make it smaller")
    with pytest.raises(ResourceError, match="something needs about 10.74 GB.*1.07 GB is available.*--force"):
        check_memory(estimate, available=2**30)
    with caplog.at_level(logging.WARNING):
        check_memory(estimate, force=True, available=2**30)
    assert "going on because of --force" in caplog.text
    check_memory(Estimate("small", 2**20, ""), available=2**30)  # fits: no refusal, no warning


def test_estimates_grow_with_their_inputs() -> None:
    small = synthetic_estimate(1_000, 10, 64, 100_000).bytes
    assert synthetic_estimate(2_000, 10, 64, 100_000).bytes > small
    assert synthetic_estimate(1_000, 20, 64, 100_000).bytes > small
    base = dict(nodes=2708, edges=10556, features=1433, feature_bytes=2708 * 18 * 8, sparse=True, hidden=256,
                layers=2, workers=4, halo_nodes=4616)
    cora = training_estimate(TrainingSizes(**base)).bytes
    assert cora < 3 * 2**30  # Cora in 4 workers: 2.36 GB measured for the tree (0.51 GB its largest process)
    assert training_estimate(TrainingSizes(**{**base, "hidden": 512})).bytes > cora
    assert training_estimate(TrainingSizes(**{**base, "features": 100_000_001})).bytes > 100 * 2**30
    joint = training_estimate(TrainingSizes(**{**base, "joint": True})).bytes
    assert cora < joint < training_estimate(TrainingSizes(**{**base, "joint": True, "two_hop": True})).bytes
    on_gpu = gpu_estimate(TrainingSizes(**base), "NVIDIA H100", ranks=4)
    assert on_gpu.what == "training 4 rank(s) on NVIDIA H100"
    assert on_gpu.bytes == int(4 * (CUDA_CONTEXT + TrainingSizes(**base).worker_data()))


# --------------------------------------------------------------------------- names, seeds, ids, parts


@pytest.mark.parametrize("name,shown", [("a" * 300, "300 characters"), ("sub/dir", "sub/dir"), ("-x", "-x")])
def test_dataset_names_are_checked(tmp_path: Path, name: str, shown: str) -> None:
    files = write_tables(tmp_path / "input")
    result = run_cli("ingest", "tables", "--name", name, "--edges", files.edges, "--nodes", files.nodes,
                     store=tmp_path / "store")
    refused(result, "--name", shown, "not a valid dataset name", "1 to 100 characters")
    assert not (tmp_path / "store" / "datasets").exists()


@pytest.mark.parametrize("args,key", [
    (["partition", "base", "--seed", "-5"], "seed = -5"),
    (["train", "base", "--strategy", "standard", "--seed", "-1"], "seed = -1"),
    (["train", "base", "--partition-seed", "-2"], "seed = -2"),
])
def test_negative_seeds_are_refused_when_the_options_are_parsed(store_with_dataset: Path, args: list[str],
                                                                key: str) -> None:
    before = snapshot(store_with_dataset)
    refused(run_cli(*args, store=store_with_dataset), key, "greater than or equal to 0")
    assert snapshot(store_with_dataset) == before


@pytest.mark.parametrize("big", ["9223372036854775808", "92233720368547758080"])
def test_ids_beyond_int64_are_refused(tmp_path: Path, big: str) -> None:
    files = write_tables(tmp_path / "input")
    lines = files.nodes.read_text().splitlines()
    lines[1] = big + "," + lines[1].split(",", 1)[1]
    files.nodes.write_text("\n".join(lines) + "\n")
    result = run_cli("ingest", "tables", "--name", "ids", "--edges", files.edges, "--nodes", files.nodes,
                     store=tmp_path / "store")
    message = refused(result, str(files.nodes), "column 'node_id'", "row 1", "outside the int64 range")
    assert "duplicate" not in message


def test_more_parts_than_nodes_is_refused(store_with_dataset: Path) -> None:
    before = snapshot(store_with_dataset)
    refused(run_cli("partition", "base", "--parts", 61, "--method", "random", store=store_with_dataset),
            "--parts", "61", "60 nodes")
    assert snapshot(store_with_dataset) == before


def test_a_configuration_error_is_one_line(tmp_path: Path) -> None:
    result = run_cli("run", REPO / "configs" / "cora_gcn.yaml", "--set", "train.rounds=0", store=tmp_path / "s")
    assert "needs warm_start" in flat(refused(result, "train"))
