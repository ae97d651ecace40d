"""Errors a user meets at the CLI boundary are one line and exit code 2, and leave the store as it
was: a full disk (a store on a 12 MB tmpfs), other OS errors, a seed torch would refuse; and
``retexo sql`` streams a result of any length in bounded memory (CSV and JSON; a table shows the
first rows), or stops it at its time limit with one line. An error raised in a worker process
reaches its parent whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from conftest import REPO, RETEXO, cli_env, run_cli, write_tables
from retexo_core.config import TrainConfig

MAX_SEED = 2**32 - 1


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def only_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# --------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 12 MB tmpfs at ``tmp_path/small`` (root only), unmounted afterwards even on failure."""
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_full_disk_is_one_line_naming_the_store_and_nothing_in_it_is_lost(small_disk: Path, tmp_path: Path) -> None:
    store = small_disk / "store"
    files = write_tables(tmp_path / "tables")
    first = run_cli("ingest", "tables", "--name", "small", "--edges", files.edges, "--nodes", files.nodes,
                    "--features", files.features, store=store)
    assert first.returncode == 0, first.stderr
    full = run_cli("ingest", "synthetic", "--name", "big", "--nodes", "200000", "--avg-degree", "10", store=store,
                   timeout=300)
    assert full.returncode == 2, full.stderr
    (line,) = error_lines(full.stderr)
    assert line.startswith(f"error: no space left on device, writing to the store {store} (")
    assert line.endswith("free): free some space, or use a store on another disk (--store)")
    assert full.stderr.rstrip().endswith(line)  # the last line; before it only progress lines
    assert list(store.rglob(".tmp-*")) == []  # the atomic writer removed its temp folder
    assert not list(store.glob("datasets/name=big/fp=*"))
    verified = run_cli("store", "verify", store=store)
    assert verified.returncode == 0 and "0 corrupt" in verified.stdout, verified.stdout
    counted = run_cli("sql", "SELECT name FROM datasets", "--format", "csv", store=store)
    assert counted.stdout.split() == ["name", "small"], counted.stderr


def test_another_os_error_is_one_line_naming_the_path(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("not a store")
    result = run_cli("sql", "SELECT 1", store=not_a_folder / "store")
    assert result.returncode == 2
    assert only_line(result.stderr) == f"error: not a directory: {not_a_folder / 'store'}"


def test_a_closed_pipe_stops_the_output_quietly(store_with_dataset: Path) -> None:
    """``retexo sql ... | head -1``: no traceback, no error about the pipe."""
    proc = subprocess.Popen([*RETEXO, "sql", "SELECT * FROM range(2000000)", "--format", "csv", "--store",
                             str(store_with_dataset)], cwd=REPO, env=cli_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"range\r\n"
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and stderr == ""


# --------------------------------------------------------------------------- seeds


def test_a_seed_beyond_what_torch_takes_is_refused_at_validation(tmp_path: Path) -> None:
    result = run_cli("train", "cora", "--seed", "99999999999999999999", store=tmp_path / "store")
    assert result.returncode == 2
    assert only_line(result.stderr) == ("error: invalid option: seed = 99999999999999999999: Input should be less "
                                        f"than or equal to {MAX_SEED}")
    preset = run_cli("run", REPO / "configs" / "cora_gcn.yaml", "--set", "train.seed=99999999999999999999",
                     store=tmp_path / "store")
    assert preset.returncode == 2 and "train.seed" in only_line(preset.stderr)
    assert not (tmp_path / "store" / "datasets").exists()


def test_every_seed_derived_from_an_accepted_seed_is_one_torch_takes() -> None:
    """``WorkerContext.generator``: seed x 1000 + offset (a layer, at most 8) + 7919 x (rank + 1), and
    ``seeded(seed x 1000 + layer)`` for parameters; torch takes 64-bit seeds, at most 2^64 - 1."""
    assert TrainConfig(seed=MAX_SEED).seed == MAX_SEED
    with pytest.raises(ValidationError, match="less than or equal to 4294967295"):
        TrainConfig(seed=MAX_SEED + 1)
    ranks = 10**6
    torch.Generator().manual_seed(MAX_SEED * 1000 + 8 + 7919 * ranks)
    torch.manual_seed(MAX_SEED * 1000 + 8)
    with pytest.raises(ValueError):  # the bound is needed: an unbounded seed fails in torch
        torch.Generator().manual_seed(99999999999999999999 * 1000)


# --------------------------------------------------------------------------- sql results in bounded memory


MEASURE = """
import resource, subprocess, sys
with open(sys.argv[1], "w") as out:
    code = subprocess.run(sys.argv[2:], stdout=out, stderr=subprocess.PIPE, text=True)
print(code.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code.stderr.strip())
"""


def test_a_huge_sql_result_streams_as_csv_in_bounded_memory_until_its_time_limit(store_with_dataset: Path,
                                                                                 tmp_path: Path) -> None:
    """300 million rows: before, the whole result was fetched first (4 GB in 7 s, nothing written);
    now rows go out as DuckDB produces them, and the time limit stops the query with one line."""
    output = tmp_path / "rows.csv"
    measured = subprocess.run([sys.executable, "-c", MEASURE, str(output), *RETEXO, "sql",
                               "SELECT * FROM range(300000000)", "--format", "csv", "--timeout", "6", "--store",
                               str(store_with_dataset)], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                              timeout=120)
    code, peak_kb, stderr = measured.stdout.strip().split(" ", 2)
    assert int(code) == 2 and stderr == ("error: the query was stopped at its time limit of 6 s; raise it with "
                                         "`retexo sql --timeout SECONDS`")
    assert int(peak_kb) < 600 * 1024, f"peak {int(peak_kb) / 1024:.0f} MB"
    with output.open() as rows:
        assert rows.readline() == "range\n"
        written = sum(1 for _ in rows)
    assert written > 100_000  # streamed while the query ran


# --------------------------------------------------------------------------- errors across processes


def raise_error(kind: str) -> None:
    """Raise one of the project's errors whose constructor takes more than a message."""
    from graphstore.errors import InputError
    from runner.launch import WorkerFailed

    if kind == "input":
        raise InputError("nodes.csv", "expected an integer", column="label", row=7)
    raise WorkerFailed(3, "worker rank 3 failed: ValueError: bad shape")


@pytest.mark.parametrize("kind", ["input", "worker"])
def test_an_error_raised_in_a_process_pool_reaches_the_parent_whole(kind: str):
    """A process pool pickles a job's error; a subclass whose constructor takes more than the message
    (``InputError``, ``WorkerFailed``) used to break the pool instead of arriving."""
    from concurrent.futures import ProcessPoolExecutor

    from graphstore.errors import InputError
    from runner.launch import WorkerFailed

    with ProcessPoolExecutor(1) as pool:
        with pytest.raises((InputError, WorkerFailed)) as caught:
            pool.submit(raise_error, kind).result()
    error = caught.value
    if kind == "input":
        assert type(error) is InputError
        assert str(error) == "nodes.csv, column 'label', row 7: expected an integer"
        assert (error.file, error.column, error.row) == ("nodes.csv", "label", 7)
    else:
        assert type(error) is WorkerFailed
        assert (error.rank, str(error)) == (3, "worker rank 3 failed: ValueError: bad shape")
