"""The store: crash safety of writers, garbage collection, and read-only SQL over the catalog."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from conftest import REPO, RETEXO, cli_env, flat, run_cli, snapshot, table_rows
from graphstore.atomic import atomic_artefact, temp_sibling, writer_lock
from graphstore.sql_query import ReadOnlyViolation, check_read_only, query
from graphstore.errors import RetexoError
from graphstore.layout import MANIFEST, TMP_PREFIX, Store
from graphstore.manifests import Manifest
from graphstore.maintenance import garbage_collect, list_artefacts

# --------------------------------------------------------------------------- crashed writers


def wait_for_temp_folder(root: Path, process: subprocess.Popen, timeout: float = 90) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(root.glob(f"datasets/*/{TMP_PREFIX}*"))
        if found:
            return found[0]
        if process.poll() is not None:
            pytest.fail(f"the writer ended before its temp folder was seen: {process.communicate()}")
        time.sleep(0.01)
    process.kill()
    pytest.fail("no temp folder appeared")


def test_writer_killed_mid_write_leaves_nothing_visible(tmp_path: Path):
    store = tmp_path / "store"
    # 200k nodes x 256 features: the temp folder exists for seconds while features are written
    command = [*RETEXO, "ingest", "synthetic", "--name", "big", "--nodes", "200000", "--avg-degree", "8",
               "--features", "256", "--store", str(store)]
    writer = subprocess.Popen(command, cwd=REPO, env=cli_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    temp = wait_for_temp_folder(store, writer)
    time.sleep(0.2)  # let it get some bytes into the temp folder
    writer.send_signal(signal.SIGKILL)
    assert writer.wait(timeout=30) == -signal.SIGKILL
    assert temp.is_dir() and any(temp.iterdir()), "the kill should have hit a half-written folder"

    visible = [p for p in store.rglob(MANIFEST) if not any(part.startswith(TMP_PREFIX) for part in p.parts)]
    assert visible == []
    assert not (temp / MANIFEST).exists()
    assert list_artefacts(Store.open(store)) == []
    assert query(Store.open(store), "SELECT count(*) FROM datasets")[1] == [(0,)]
    assert query(Store.open(store), "SELECT count(*) FROM nodes")[1] == [(0,)]
    listing = run_cli("store", "ls", store=store)
    assert listing.returncode == 0 and table_rows(listing.stdout) == []

    gc = run_cli("store", "gc", store=store)
    assert gc.returncode == 0, gc.stderr
    assert "removed 1 temporary item(s)" in flat(gc.stdout)
    assert table_rows(gc.stdout)[0][0] == str(temp.relative_to(store))
    assert not temp.exists()
    assert list(store.rglob(f"{TMP_PREFIX}*")) == []


def test_gc_leaves_a_running_writers_temp_folder_alone(tmp_path: Path):
    store = Store.open(tmp_path)
    target = store.dataset_dir("x", "0123")
    target.parent.mkdir(parents=True)
    temp = temp_sibling(target)
    temp.mkdir()
    (temp / "nodes.parquet").write_bytes(b"partial")
    with writer_lock(store, target):  # a live writer holds the target's lock
        assert garbage_collect(store) == ([], [])
        assert temp.exists()
    removed, _ = garbage_collect(store)
    assert removed == [(temp, len(b"partial"))]
    assert not temp.exists()


def test_failed_write_removes_its_temp_folder_and_keeps_the_target_absent(tmp_path: Path):
    store = Store.open(tmp_path)
    target = store.dataset_dir("x", "0123")
    with pytest.raises(RuntimeError):
        with atomic_artefact(store, target) as writer:
            (writer.path / "nodes.parquet").write_bytes(b"partial")
            raise RuntimeError("boom")
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_completed_artefact_has_manifest_written_last(tmp_path: Path):
    store = Store.open(tmp_path)
    target = store.dataset_dir("x", "0123")
    with atomic_artefact(store, target) as writer:
        (writer.path / "nodes.parquet").write_bytes(b"data")
        writer.manifest = Manifest(kind="dataset", fp="0123")
        assert not target.exists()  # nothing visible before commit
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["kind"] == "dataset" and "created_at" in manifest
    assert (target / MANIFEST).stat().st_mtime_ns >= (target / "nodes.parquet").stat().st_mtime_ns


# --------------------------------------------------------------------------- read-only SQL


@pytest.mark.parametrize("statement, kind, via", [
    ("CREATE TABLE t AS SELECT 1 AS a", "CREATE", "cli"),
    ("INSERT INTO run_history VALUES ('r', 'e', now(), '')", "INSERT", "cli"),
    ("DROP VIEW nodes", "DROP", "cli"),
    ("COPY (SELECT * FROM nodes) TO '{out}/leak.csv'", "COPY", "cli"),
    ("ATTACH '{out}/other.duckdb' AS other", "ATTACH", "cli"),
    ("EXPLAIN ANALYZE COPY (SELECT 1) TO '{out}/leak.csv'", "EXPLAIN COPY", "app"),  # ANALYZE would run it
    ("SELECT 1; DROP VIEW nodes", "DROP", "app"),
])
def test_sql_refuses_writes(store_with_dataset: Path, tmp_path: Path, statement: str, kind: str, via: str):
    """Refused with exit code 2 and a clear message; nothing written in the store or elsewhere."""
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(store_with_dataset)
    if via == "cli":
        result = run_cli("sql", statement.format(out=out), store=store_with_dataset)
        assert result.returncode == 2, result.stdout
        message = flat(result.stderr)
    else:  # the same command line in-process (typer's runner): faster, same message
        result = CliRunner().invoke(app, ["sql", statement.format(out=out), "--store", str(store_with_dataset)])
        assert isinstance(result.exception, ReadOnlyViolation), result.output
        message = "error: " + flat(str(result.exception))
    assert message.startswith("error: refused: `retexo sql` is read-only"), message
    assert f"statement of type {kind} " in message, message
    assert "only SELECT queries" in message
    assert snapshot(store_with_dataset) == before
    assert list(out.iterdir()) == []  # no file written, no database attached/created


@pytest.mark.parametrize("statement", ["SET threads = 1", "PRAGMA enable_profiling", "CALL pragma_version()",
                                       "INSTALL httpfs", "LOAD json", "EXPORT DATABASE '/tmp/x'",
                                       "UPDATE run_history SET run = 'x'", "DETACH catalog", "CHECKPOINT",
                                       "EXPLAIN CREATE TABLE t (a INT)"])
def test_other_non_queries_are_refused(statement: str):
    with pytest.raises(ReadOnlyViolation, match="read-only"):
        check_read_only(statement)


@pytest.mark.parametrize("statement", ["SELECT 1", "WITH a AS (SELECT 1) SELECT * FROM a", "EXPLAIN SELECT 1",
                                       "EXPLAIN ANALYZE SELECT 1", "explain (format json) select 1",
                                       "/* comment */ SELECT 2", "FROM nodes", "DESCRIBE nodes", "SUMMARIZE nodes"])
def test_queries_are_allowed(statement: str):
    check_read_only(statement)


def test_sql_formats(store_with_dataset: Path):
    sql = "SELECT name, num_nodes, num_classes FROM datasets"
    csv_out = run_cli("sql", sql, "--format", "csv", store=store_with_dataset)
    assert csv_out.returncode == 0, csv_out.stderr
    assert csv_out.stdout.splitlines() == ["name,num_nodes,num_classes", "base,60,3"]
    json_out = run_cli("sql", sql, "--format", "json", store=store_with_dataset)
    assert json.loads(json_out.stdout) == [{"name": "base", "num_nodes": 60, "num_classes": 3}]
    table_out = run_cli("sql", sql, store=store_with_dataset)  # table is the default
    assert table_out.returncode == 0
    assert table_rows(table_out.stdout) == [["base", "60", "3"]]
    assert "num_nodes" in table_out.stdout


def test_sql_bad_format_and_bad_sql(store_with_dataset: Path):
    bad_format = run_cli("sql", "SELECT 1", "--format", "xml", store=store_with_dataset)
    assert bad_format.returncode == 2
    assert "--format must be table, csv or json" in flat(bad_format.stderr)
    for statement, words in (("SELEC 1", "SQL does not parse"), ("SELECT nope FROM nodes", "query failed")):
        with pytest.raises(RetexoError, match=words):
            query(Store.open(store_with_dataset), statement)


def test_views_exist_with_their_columns_on_an_empty_store(tmp_path: Path):
    store = Store.open(tmp_path)
    expected = {
        "datasets": ["name", "fp", "num_nodes", "num_edges", "num_features", "num_classes"],
        "nodes": ["dataset", "node_id", "label", "split"],
        "edges": ["dataset", "src", "dst"],
        "partitions": ["dataset", "partition", "method", "parts", "seed", "edge_cut", "halo_total"],
        "partition_nodes": ["partition", "part", "node_id", "label", "split"],
        "partition_edges": ["partition", "part", "src", "dst"],
        "halo": ["partition", "part", "node_id", "owner"],
        "partition_stats": ["partition", "part", "owned_nodes", "local_edges", "cut_edges", "halo_nodes", "train",
                            "val", "test"],
    }
    for view, columns in expected.items():
        names, rows = query(store, f"SELECT * FROM {view}")
        assert rows == []
        assert names[:len(columns)] == columns, view


def test_views_keep_their_columns_once_filled(cora):
    for view, columns in {
        "datasets": ["name", "fp", "num_nodes", "num_edges", "num_features", "num_classes"],
        "partitions": ["dataset", "partition", "method", "parts", "seed", "edge_cut", "halo_total"],
        "partition_stats": ["partition", "part", "owned_nodes", "local_edges", "cut_edges", "halo_nodes", "train",
                            "val", "test"],
    }.items():
        names, rows = query(cora.store, f"SELECT * FROM {view} LIMIT 1")
        assert names[:len(columns)] == columns and rows, view


def test_environment_variable_selects_the_store(store_with_dataset: Path):
    env = {**cli_env(), "RETEXO_STORE": str(store_with_dataset)}
    result = subprocess.run([*RETEXO, "sql", "SELECT name FROM datasets", "--format", "csv"], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["name", "base"]


def test_store_commands_do_not_import_torch():
    """ingest / partition / sql / store start fast: torch and retexo_core load only for training."""
    code = ("import sys, cli.app; heavy = sorted(m for m in ('torch', 'torch_geometric', 'retexo_core', 'ogb') "
            "if m in sys.modules); print(heavy); sys.exit(bool(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_run_fingerprint_of_digits_only_stays_text_in_the_runs_view(tmp_path: Path):
    """A 16-hex fingerprint can be all decimal digits; the views must not type it as a number."""
    from graphstore.catalog import refresh_catalog
    from graphstore.history import record_run_event

    store = Store.open(tmp_path)
    record_run_event(store, "1234567890123456", "started", "retexo")
    refresh_catalog(store)
    _, rows = query(store, "SELECT run, status FROM runs")
    assert rows == [("1234567890123456", "started")]
