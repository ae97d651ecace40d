"""A store that moves: after the store folder is copied elsewhere and the original deleted, one
``retexo`` command on the copy (any; ``retexo store ls`` is the documented one) rewrites its
``catalog.duckdb`` for the new path, saying so in one line, and then any DuckDB client (here the
Python ``duckdb`` module, a fresh process, another working directory, no project code) answers
``SELECT count(*)`` on every view of the catalog. ``retexo sql`` works on the copy as it is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cli_env, run_cli, write_tables
from graphstore.catalog import VIEW_NAMES, catalog_store_root
from graphstore.layout import Store
from graphstore.sql_query import query

# Plain DuckDB, run from another working directory: the count of every view (and table) of the
# catalog, or the error it gives.
COUNT_EVERY_VIEW = """
import json, sys, duckdb
con = duckdb.connect(sys.argv[1], read_only=True)
names = [r[0] for r in con.execute(
    "SELECT view_name FROM duckdb_views() WHERE NOT internal UNION ALL SELECT table_name FROM duckdb_tables()"
).fetchall()]
counts = {}
for name in names:
    try:
        counts[name] = con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
    except duckdb.Error as exc:
        counts[name] = str(exc).splitlines()[0]
print(json.dumps(counts))
"""


def count_every_view(catalog: Path, cwd: Path) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", COUNT_EVERY_VIEW, str(catalog)], cwd=cwd, capture_output=True,
                            text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small store with a dataset, a partition and a trained run (every kind of view has rows)."""
    root = tmp_path_factory.mktemp("original") / "store"
    files = write_tables(tmp_path_factory.mktemp("tables"), num_nodes=90)
    for args in (("ingest", "tables", "--name", "small", "--edges", files.edges, "--nodes", files.nodes, "--features",
                  files.features, "--undirected"),
                 ("partition", "small", "--method", "random", "--parts", "2"),
                 ("train", "small", "--parts", "2", "--partition-method", "random", "--rounds", "3", "--hidden", "8")):
        result = run_cli(*args, store=root, timeout=300)
        assert result.returncode == 0, result.stderr
    return root


@pytest.mark.slow  # the store holds a trained run (workers spawned)
def test_a_copied_store_answers_every_catalog_view_from_plain_duckdb(original: Path, tmp_path: Path) -> None:
    expected = {view: query(Store.open(original), f"SELECT count(*) FROM {view}")[1][0][0] for view in VIEW_NAMES}
    assert all(expected[v] > 0 for v in ("datasets", "nodes", "partitions", "halo", "runs", "comm_log", "predictions"))
    copy = tmp_path / "elsewhere" / "copied-store"
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    other_cwd = tmp_path / "somewhere-else"
    other_cwd.mkdir()

    stale = count_every_view(copy / "catalog.duckdb", other_cwd)  # what a user met before
    assert "No files found that match the pattern" in str(stale["nodes"])

    assert [list(row) for row in query(Store.open(copy), "SELECT count(*) FROM nodes")[1]] == [[expected["nodes"]]]
    listed = run_cli("store", "ls", store=copy)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr.strip() == (f"catalog.duckdb was written for the store at {original}; its views now "
                                     f"read {copy}")
    assert catalog_store_root(Store.open(copy)) == str(copy)

    counts = count_every_view(copy / "catalog.duckdb", other_cwd)
    assert counts == {**expected, "catalog_info": 1}
    again = run_cli("sql", "SELECT count(*) FROM edges", "--format", "csv", store=copy)
    assert again.returncode == 0 and again.stderr == ""  # said once: the catalog now names the copy


def test_a_catalog_of_an_earlier_version_is_rewritten_quietly(store_with_dataset: Path) -> None:
    import duckdb

    catalog = store_with_dataset / "catalog.duckdb"
    con = duckdb.connect(str(catalog))
    con.execute("DROP TABLE catalog_info")  # as written before the catalog recorded its store root
    con.close()
    assert catalog_store_root(Store.open(store_with_dataset)) == ""
    result = run_cli("sql", "SELECT count(*) FROM nodes", "--format", "csv", store=store_with_dataset)
    assert result.returncode == 0 and result.stderr == ""
    assert catalog_store_root(Store.open(store_with_dataset)) == str(store_with_dataset)


def test_a_catalog_held_open_by_a_client_is_left_alone(store_with_dataset: Path, tmp_path: Path) -> None:
    """A DuckDB session holding the catalog (read-write lock) neither blocks nor fails a command."""
    copy = tmp_path / "copy"
    shutil.copytree(store_with_dataset, copy)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, duckdb; con = duckdb.connect(sys.argv[1]); "
                               "print('holding', flush=True); sys.stdin.readline()", str(copy / "catalog.duckdb")],
                              cwd=REPO, env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        result = run_cli("sql", "SELECT count(*) FROM nodes", "--format", "csv", store=copy)
        assert result.returncode == 0 and result.stdout.split() == ["count_star()", "60"], result.stderr
    finally:
        holder.communicate("\n", timeout=30)
    listed = run_cli("store", "ls", store=copy)
    assert f"its views now read {copy}" in listed.stderr
