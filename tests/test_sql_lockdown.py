"""`retexo sql` reads the store and nothing else, under a time limit; a damaged file breaks only the
queries that read it; queries and writers never wait for or fail each other (catalog.duckdb).

Refusals run in-process through ``graphstore.sql_query.query`` (the function the command calls);
one of each kind also runs through the real CLI in a subprocess for its exit code and its single
line on stderr.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from conftest import REPO, cli_env, flat, run_cli, write_tables
from graphstore.atomic import writer_lock
from graphstore.catalog import VIEW_NAMES, lock_down, refresh_catalog
from graphstore.sql_query import OutsideStore, QueryTimeout, query
from graphstore.errors import RetexoError, StoreError
from graphstore.history import record_run_event
from graphstore.layout import Store

SECRET = "not-for-sql-7f3a"


def only_line(stderr: str) -> str:
    """stderr of a refused command: exactly one line, no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def dataset_file(root: Path, name: str) -> Path:
    (found,) = root.glob(f"datasets/name=base/fp=*/{name}")
    return found


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# --------------------------------------------------------------------------- reads outside the store


@pytest.mark.parametrize("sql, path", [
    ("SELECT * FROM read_text('/etc/shadow')", "/etc/shadow"),
    ("SELECT * FROM read_csv('/etc/passwd')", "/etc/passwd"),
    ("SELECT * FROM read_csv_auto('/etc/passwd')", "/etc/passwd"),
    ("SELECT * FROM read_json('/etc/passwd')", "/etc/passwd"),
    ("SELECT * FROM read_parquet('/x.parquet')", "/x.parquet"),
    ("SELECT * FROM read_blob('/etc/hostname')", "/etc/hostname"),
    ("SELECT * FROM glob('/root/*')", "/root/*"),
    ("SELECT * FROM read_text('/proc/self/environ')", "/proc/self/environ"),
    ("SELECT * FROM read_text('{store}/../secret.txt')", "{store}/../secret.txt"),
    ("SELECT * FROM read_text('{store}/datasets/../../secret.txt')", "{store}/datasets/../../secret.txt"),
    ("SELECT count(*) FROM nodes, read_text('/etc/hostname')", "/etc/hostname"),
    ("SELECT * FROM read_csv('https://example.invalid/x.csv')", "https://example.invalid/x.csv"),
    ("SELECT * FROM read_parquet('s3://bucket/x.parquet')", "s3://bucket/x.parquet"),
])
def test_reads_outside_the_store_are_refused(store_with_dataset: Path, sql: str, path: str):
    (store_with_dataset.parent / "secret.txt").write_text(SECRET)
    sql, path = sql.format(store=store_with_dataset), path.format(store=store_with_dataset)
    with pytest.raises(OutsideStore) as refused:
        query(Store.open(store_with_dataset), sql)
    assert str(refused.value) == (f"refused: `retexo sql` reads only the store {store_with_dataset}; "
                                  f"'{path}' is outside it")


def test_a_refused_read_is_one_line_and_exit_code_2(store_with_dataset: Path):
    result = run_cli("sql", "SELECT * FROM read_text('/etc/shadow')", store=store_with_dataset)
    assert result.returncode == 2 and result.stdout == ""
    assert only_line(result.stderr) == (f"error: refused: `retexo sql` reads only the store {store_with_dataset}; "
                                        "'/etc/shadow' is outside it")


def test_a_url_is_refused_without_any_network_attempt(store_with_dataset: Path):
    """A local server stands in for the internet: nothing may connect to it (no extension install either)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for scheme in ("http", "https"):
            url = f"{scheme}://127.0.0.1:{port}/x.csv"
            result = run_cli("sql", f"SELECT * FROM read_csv('{url}')", store=store_with_dataset)
            assert result.returncode == 2
            assert f"'{url}' is outside it" in only_line(result.stderr)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection is waiting


def test_the_store_itself_is_readable(store_with_dataset: Path):
    nodes = dataset_file(store_with_dataset, "nodes.parquet")
    _, rows = query(Store.open(store_with_dataset), f"SELECT count(*) FROM read_parquet('{nodes}')")
    assert rows == [(60,)]


# --------------------------------------------------------------------------- symbolic links


@pytest.mark.parametrize("link, points_to", [
    ("datasets/name=base/leak.txt", "secret.txt"),  # a file outside
    ("datasets/name=elsewhere", "outside"),  # a folder outside: a glob would list its names
    ("runs", "/etc"),
    # inside, but DuckDB folds '..' as text before resolving links: the query below would read the
    # file next to the store through it (checked with DuckDB 2.0)
    ("datasets/up", "store"),
    ("nodes-link.parquet", "store/datasets/name=base"),
])
def test_a_store_with_a_symbolic_link_is_not_queried(store_with_dataset: Path, link: str, points_to: str):
    outside = store_with_dataset.parent
    (outside / "secret.txt").write_text(SECRET)
    (outside / "outside").mkdir()
    (outside / "outside" / "secret.txt").write_text(SECRET)
    target = outside / points_to if not points_to.startswith("/") else Path(points_to)
    (store_with_dataset / link).symlink_to(target)
    sql = f"SELECT content FROM read_text('{store_with_dataset}/datasets/up/../secret.txt')"
    with pytest.raises(OutsideStore) as refused:
        query(Store.open(store_with_dataset), sql)
    assert str(refused.value) == (
        f"refused: `retexo sql` reads only the store {store_with_dataset}, and {store_with_dataset / link} is a "
        f"symbolic link (to {target}), through which a query could read outside it; remove the link (copy the data "
        f"into the store instead)")
    result = run_cli("sql", "SELECT count(*) FROM datasets", store=store_with_dataset) if link == "runs" else None
    if result is not None:
        assert result.returncode == 2 and SECRET not in result.stdout
        assert only_line(result.stderr).startswith("error: refused: `retexo sql` reads only the store")


def test_duckdb_itself_refuses_to_read_through_a_link_out(tmp_path: Path):
    """Under the link check, the locked-down connection resolves a link out, and '..' out of the root."""
    root = tmp_path / "store"
    root.mkdir()
    (tmp_path / "secret.txt").write_text(SECRET)
    (root / "leak.txt").symlink_to(tmp_path / "secret.txt")
    con = duckdb.connect()
    lock_down(con, root)
    for path in (root / "leak.txt", f"{root}/../secret.txt"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"SELECT content FROM read_text('{path}')").fetchall()
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")


# --------------------------------------------------------------------------- time limit


def test_a_long_query_is_stopped_at_the_time_limit(store_with_dataset: Path):
    result = run_cli("sql", "SELECT count(*) FROM range(1000000000000) a, range(1000) b", "--timeout", "1",
                     store=store_with_dataset)
    assert result.returncode == 2
    assert only_line(result.stderr) == ("error: the query was stopped at its time limit of 1 s; "
                                        "raise it with `retexo sql --timeout SECONDS`")


def test_the_time_limit_must_be_positive(store_with_dataset: Path):
    with pytest.raises(RetexoError, match="--timeout must be a positive number of seconds, not 0"):
        query(Store.open(store_with_dataset), "SELECT 1", timeout=0)


def test_a_query_within_the_limit_is_unaffected(store_with_dataset: Path):
    store = Store.open(store_with_dataset)
    assert query(store, "SELECT count(*) FROM nodes", timeout=30)[1] == [(60,)]
    with pytest.raises(QueryTimeout):
        query(store, "SELECT count(*) FROM nodes, range(1000000000000)", timeout=0.5)
    assert query(store, "SELECT count(*) FROM edges", timeout=30)[1][0][0] > 0  # nothing left behind


def test_a_query_is_held_to_half_the_available_memory(store_with_dataset: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No temp directory, so nothing spills: past the limit the query fails with one line."""
    import graphstore.catalog as catalog

    monkeypatch.setattr(catalog, "available_memory", lambda: 600 * 2**20)
    store = Store.open(store_with_dataset)
    assert query(store, "SELECT current_setting('memory_limit')")[1] == [("300.0 MiB",)]
    with pytest.raises(RetexoError, match=r"the query needs more memory than `retexo sql` allows "
                                          r"\(half the available memory, 314.57 MB now\)"):
        query(store, "SELECT max(length(l)) FROM (SELECT list(range) AS l FROM range(200000000) GROUP BY range % 3)")
    assert query(store, "SELECT count(*) FROM nodes")[1] == [(60,)]


# --------------------------------------------------------------------------- damaged files


def test_a_truncated_parquet_breaks_only_its_view(store_with_dataset: Path):
    edges = dataset_file(store_with_dataset, "edges.parquet")
    truncate(edges)
    ok = run_cli("sql", "SELECT count(*) FROM datasets", "--format", "csv", store=store_with_dataset)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["count_star()", "1"]
    broken = run_cli("sql", "SELECT count(*) FROM edges", store=store_with_dataset)
    assert broken.returncode == 2
    line = only_line(broken.stderr)
    assert line.startswith(f"error: the store file {edges} cannot be read (view edges): ")
    assert line.endswith("; run `retexo store verify --repair`")
    store = Store.open(store_with_dataset)
    assert query(store, "SELECT count(*) FROM nodes")[1] == [(60,)]
    # JOIN ... USING: DuckDB cannot list its tables, the view names are found in the text instead
    assert query(store, "SELECT count(*) FROM nodes JOIN partitions USING (dataset)")[1] == [(0,)]
    with pytest.raises(StoreError, match="cannot be read"):
        query(store, "SELECT count(*) FROM nodes n JOIN edges e ON n.node_id = e.src")


def test_a_damaged_page_found_while_scanning_names_the_file(store_with_dataset: Path):
    """The footer reads fine (the view is built); the data pages do not."""
    nodes = dataset_file(store_with_dataset, "nodes.parquet")
    data = bytearray(nodes.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    for k in range(40, len(data) - 8 - footer - 10):
        data[k] ^= 0xFF
    nodes.write_bytes(bytes(data))
    store = Store.open(store_with_dataset)
    with pytest.raises(StoreError) as unreadable:
        query(store, "SELECT sum(node_id), min(split) FROM nodes")
    message = str(unreadable.value)
    assert message.startswith(f"the store file {nodes} cannot be read: ") and "\n" not in message
    assert message.endswith("; run `retexo store verify --repair`")


def test_a_truncated_manifest_breaks_only_its_view(store_with_dataset: Path):
    manifest = dataset_file(store_with_dataset, "manifest.json")
    truncate(manifest)
    broken = run_cli("sql", "SELECT name FROM datasets", store=store_with_dataset)
    assert broken.returncode == 2
    assert only_line(broken.stderr).startswith(f"error: the store file {manifest} cannot be read (view datasets): ")
    assert query(Store.open(store_with_dataset), "SELECT count(*) FROM edges")[1][0][0] > 0


def test_a_damaged_event_breaks_the_views_built_on_it(tmp_path: Path):
    """``runs`` reads ``run_history``; ``completed_runs`` does not."""
    store = Store.open(tmp_path)
    record_run_event(store, "00aa", "started", "retexo")
    (event,) = store.run_dir("00aa").glob("events/*.json")
    truncate(event)
    assert query(store, "SELECT count(*) FROM completed_runs")[1] == [(0,)]
    for sql in ("SELECT count(*) FROM run_history", "SELECT run, status FROM runs"):
        with pytest.raises(StoreError, match=f"the store file {event} cannot be read \\(view run_history\\)"):
            query(store, sql)


def test_a_writer_succeeds_over_a_damaged_file_and_the_catalog_names_it(store_with_dataset: Path, tmp_path: Path):
    edges = dataset_file(store_with_dataset, "edges.parquet")
    truncate(edges)
    files = write_tables(tmp_path / "other", seed=1)
    result = run_cli("ingest", "tables", "--name", "other", "--edges", files.edges, "--nodes", files.nodes,
                     "--features", files.features, store=store_with_dataset)
    assert result.returncode == 0, result.stderr
    assert f"catalog view edges is unreadable: the store file {edges} cannot be read" in flat(result.stderr)
    con = duckdb.connect(str(store_with_dataset / "catalog.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT name FROM datasets ORDER BY name").fetchall() == [("base",), ("other",)]
        with pytest.raises(duckdb.Error, match=f"the store file {edges} cannot be read"):
            con.execute("SELECT count(*) FROM edges").fetchall()
    finally:
        con.close()


# --------------------------------------------------------------------------- the catalog file


def catalog_columns(root: Path) -> dict[str, list[tuple[str, str]]]:
    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    try:
        return {view: [(r[0], r[1]) for r in con.execute(f"DESCRIBE {view}").fetchall()] for view in VIEW_NAMES}
    finally:
        con.close()


def query_columns(root: Path) -> dict[str, list[tuple[str, str]]]:
    return {view: [(r[0], r[1]) for r in query(Store.open(root), f"DESCRIBE {view}")[1]] for view in VIEW_NAMES}


@pytest.mark.parametrize("filled", [False, True])
def test_the_catalog_has_the_views_of_the_query_path(store_with_dataset: Path, tmp_path: Path, filled: bool):
    root = store_with_dataset if filled else tmp_path / "empty"
    refresh_catalog(Store.open(root))
    assert catalog_columns(root) == query_columns(root)


def test_refresh_replaces_the_catalog_file_and_drops_a_stale_wal(store_with_dataset: Path):
    catalog = store_with_dataset / "catalog.duckdb"
    wal = store_with_dataset / "catalog.duckdb.wal"
    wal.write_bytes(b"a WAL of an older catalog file")
    before = catalog.stat().st_ino
    refresh_catalog(Store.open(store_with_dataset))
    assert catalog.stat().st_ino != before and not wal.exists()
    assert not list(store_with_dataset.glob(".tmp-*"))
    assert catalog_columns(store_with_dataset)["datasets"][0] == ("name", "VARCHAR")


def test_a_failed_refresh_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    store = Store.open(tmp_path)
    (store.catalog_path / "in-the-way").mkdir(parents=True)  # the rename cannot replace a folder
    with caplog.at_level(logging.WARNING, logger="graphstore.catalog"):
        refresh_catalog(store)
    assert f"the catalog {store.catalog_path} was not refreshed" in caplog.text
    assert not list(tmp_path.glob(".tmp-*"))
    assert query(store, "SELECT count(*) FROM datasets")[1] == [(0,)]  # sql does not need the catalog


# --------------------------------------------------------------------------- readers and writers


HOLDER = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])  # read-write: DuckDB's exclusive file lock, like a duckdb CLI session
con.execute("SELECT count(*) FROM datasets").fetchall()
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_session_on_the_catalog_blocks_neither_ingest_nor_sql(store_with_dataset: Path, tmp_path: Path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store_with_dataset / "catalog.duckdb")], cwd=REPO,
                              env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        files = write_tables(tmp_path / "other", seed=1)
        ingest = run_cli("ingest", "tables", "--name", "other", "--edges", files.edges, "--nodes", files.nodes,
                         "--features", files.features, store=store_with_dataset)
        assert ingest.returncode == 0, ingest.stderr
        assert "lock" not in ingest.stderr.lower()
        sql = run_cli("sql", "SELECT name FROM datasets ORDER BY name", "--format", "csv", store=store_with_dataset)
        assert sql.returncode == 0, sql.stderr
        assert sql.stdout.split() == ["name", "base", "other"]
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
    assert len(catalog_columns(store_with_dataset)) == len(VIEW_NAMES)


def test_a_query_does_not_wait_for_a_refresh_and_a_refresh_does_not_break_a_reader(store_with_dataset: Path):
    store = Store.open(store_with_dataset)
    with writer_lock(store, store.catalog_path):  # a writer is refreshing the catalog right now
        assert query(store, "SELECT count(*) FROM datasets")[1] == [(1,)]
    reader = duckdb.connect(str(store.catalog_path), read_only=True)
    try:
        refresh_catalog(store)  # replaces the file under the open reader
        assert reader.execute("SELECT name FROM datasets").fetchall() == [("base",)]
    finally:
        reader.close()
