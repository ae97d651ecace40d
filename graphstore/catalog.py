"""The DuckDB catalog: SQL views over the store's Parquet/JSON files, and nothing else.

Views are ``CREATE OR REPLACE VIEW … read_parquet(glob, hive_partitioning = true)``, so the catalog
is rebuilt from the files at any time (``refresh_catalog``); a view whose glob matches no file yet
is an empty view with the same columns, so users' SQL never breaks on an empty store. Run history
is files too (``graphstore.history``). Column names are a contract: add, never rename.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb

from graphstore.atomic import writer_lock
from graphstore.errors import RetexoError
from graphstore.layout import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ViewSpec:
    """One catalog view.

    ``source`` is ``parquet`` or ``json`` (manifests); ``pattern`` a glob relative to the store root;
    ``select`` the SELECT list over the file columns (hive keys arrive as VARCHAR);
    ``columns`` the output columns and types, used for the empty view.
    """

    name: str
    source: str
    pattern: str
    select: str
    columns: tuple[tuple[str, str], ...]
    json_columns: tuple[tuple[str, str], ...] = ()


def _cols(spec: str) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(item.split()) for item in spec.split(","))  # type: ignore[misc]


VIEWS: list[ViewSpec] = [
    ViewSpec(
        "datasets", "json", "datasets/name=*/fp=*/manifest.json",
        "name, fp, num_nodes, num_edges, num_features, num_classes, \"symmetric\", created_at",
        _cols("name VARCHAR, fp VARCHAR, num_nodes BIGINT, num_edges BIGINT, num_features BIGINT, "
              "num_classes BIGINT, symmetric BOOLEAN, created_at TIMESTAMP"),
    ),
    ViewSpec(
        "nodes", "parquet", "datasets/name=*/fp=*/nodes.parquet",
        "fp AS dataset, node_id, label, split",
        _cols("dataset VARCHAR, node_id BIGINT, label BIGINT, split VARCHAR"),
    ),
    ViewSpec(
        "edges", "parquet", "datasets/name=*/fp=*/edges.parquet",
        "fp AS dataset, src, dst",
        _cols("dataset VARCHAR, src BIGINT, dst BIGINT"),
    ),
    ViewSpec(
        "partitions", "json", "partitions/dataset=*/fp=*/manifest.json",
        "dataset, fp AS partition, method, parts, seed, edge_cut, halo_total, dataset_name, objective, "
        "seconds, created_at, stable_from, kept_nodes, moved_nodes, new_nodes",
        _cols("dataset VARCHAR, partition VARCHAR, method VARCHAR, parts BIGINT, seed BIGINT, edge_cut BIGINT, "
              "halo_total BIGINT, dataset_name VARCHAR, objective VARCHAR, seconds DOUBLE, created_at TIMESTAMP, "
              "stable_from VARCHAR, kept_nodes BIGINT, moved_nodes BIGINT, new_nodes BIGINT"),
        _cols("dataset VARCHAR, fp VARCHAR, method VARCHAR, parts BIGINT, seed BIGINT, edge_cut BIGINT, "
              "halo_total BIGINT, dataset_name VARCHAR, objective VARCHAR, seconds DOUBLE, created_at TIMESTAMP, "
              "stable_from VARCHAR, kept_nodes BIGINT, moved_nodes BIGINT, new_nodes BIGINT"),
    ),
    ViewSpec(
        "partition_nodes", "parquet", "partitions/dataset=*/fp=*/part=*/nodes.parquet",
        "fp AS partition, CAST(part AS INTEGER) AS part, node_id, label, split",
        _cols("partition VARCHAR, part INTEGER, node_id BIGINT, label BIGINT, split VARCHAR"),
    ),
    ViewSpec(
        "partition_edges", "parquet", "partitions/dataset=*/fp=*/part=*/edges.parquet",
        "fp AS partition, CAST(part AS INTEGER) AS part, src, dst",
        _cols("partition VARCHAR, part INTEGER, src BIGINT, dst BIGINT"),
    ),
    ViewSpec(
        "halo", "parquet", "partitions/dataset=*/fp=*/part=*/halo.parquet",
        "fp AS partition, CAST(part AS INTEGER) AS part, node_id, owner",
        _cols("partition VARCHAR, part INTEGER, node_id BIGINT, owner BIGINT"),
    ),
    ViewSpec(
        "partition_stats", "parquet", "partitions/dataset=*/fp=*/stats.parquet",
        "fp AS partition, CAST(part AS INTEGER) AS part, owned_nodes, local_edges, cut_edges, halo_nodes, "
        "train, val, test, balance",
        _cols("partition VARCHAR, part INTEGER, owned_nodes BIGINT, local_edges BIGINT, cut_edges BIGINT, "
              "halo_nodes BIGINT, train BIGINT, val BIGINT, test BIGINT, balance DOUBLE"),
    ),
 ViewSpec(
        "completed_runs", "json", "runs/run=*/manifest.json",
        "fp AS run, dataset, partition, strategy, model, setting, test_acc, val_acc, total_bytes, sim_comm_s, "
        "wall_s, status, dataset_name, label, method, parts, created_at",
        _cols("run VARCHAR, dataset VARCHAR, partition VARCHAR, strategy VARCHAR, model VARCHAR, setting VARCHAR, "
              "test_acc DOUBLE, val_acc DOUBLE, total_bytes BIGINT, sim_comm_s DOUBLE, wall_s DOUBLE, status VARCHAR, "
              "dataset_name VARCHAR, label VARCHAR, method VARCHAR, parts BIGINT, created_at TIMESTAMP"),
        _cols("fp VARCHAR, dataset VARCHAR, partition VARCHAR, strategy VARCHAR, model VARCHAR, setting VARCHAR, "
              "test_acc DOUBLE, val_acc DOUBLE, total_bytes BIGINT, sim_comm_s DOUBLE, wall_s DOUBLE, status VARCHAR, "
              "dataset_name VARCHAR, label VARCHAR, method VARCHAR, parts BIGINT, created_at TIMESTAMP"),
    ),
    ViewSpec(
        "comm_log", "parquet", "runs/run=*/comm.parquet",
        "run, layer, epoch, kind, src, dst, bytes, op, hops",
        _cols("run VARCHAR, layer BIGINT, epoch BIGINT, kind VARCHAR, src BIGINT, dst BIGINT, bytes BIGINT, "
              "op BIGINT, hops BIGINT"),
    ),
    ViewSpec(
        "layer_metrics", "parquet", "runs/run=*/metrics.parquet",
        "run, layer, round, split, loss, acc",
        _cols("run VARCHAR, layer BIGINT, round BIGINT, split VARCHAR, loss DOUBLE, acc DOUBLE"),
    ),
    ViewSpec(
        "run_evaluation", "parquet", "runs/run=*/evaluation.parquet",
        "run, split, accuracy, macro_f1, roc_auc, nodes",
        _cols("run VARCHAR, split VARCHAR, accuracy DOUBLE, macro_f1 DOUBLE, roc_auc DOUBLE, nodes BIGINT"),
    ),
    ViewSpec(
        "run_history", "json", "runs/run=*/events/*.json",
        "run, event, happened_at, detail",
        _cols("run VARCHAR, event VARCHAR, happened_at TIMESTAMP, detail VARCHAR"),
    ),
    ViewSpec(
        "embeddings", "parquet", "runs/run=*/layer=*/part=*/embeddings.parquet",
        "run, CAST(layer AS INTEGER) AS layer, CAST(part AS INTEGER) AS part, node_id, h",
        _cols("run VARCHAR, layer INTEGER, part INTEGER, node_id BIGINT, h FLOAT[]"),
    ),
    ViewSpec(
        "prediction_rows", "parquet", "runs/run=*/layer=*/part=*/predictions.parquet",
        "run, CAST(part AS INTEGER) AS part, node_id, predicted, score, split",
        _cols("run VARCHAR, part INTEGER, node_id BIGINT, predicted BIGINT, score FLOAT, split VARCHAR"),
    ),
    ViewSpec(
        "promotions", "json", "pipelines/name=*/decisions/*.json",
        "pipeline, decided_at, decision, run, dataset, val_acc, incumbent, incumbent_val_acc, "
        "incumbent_evaluation_run, tolerance, promoted_run, serving_run, reason",
        _cols("pipeline VARCHAR, decided_at TIMESTAMP, decision VARCHAR, run VARCHAR, dataset VARCHAR, "
              "val_acc DOUBLE, incumbent VARCHAR, incumbent_val_acc DOUBLE, incumbent_evaluation_run VARCHAR, "
              "tolerance DOUBLE, promoted_run VARCHAR, serving_run VARCHAR, reason VARCHAR"),
    ),
]

# ``runs``: completed runs (from their manifests) plus runs that only have history so far
# (started / failed), with the latest event as their status.
RUNS_VIEW = """
CREATE OR REPLACE VIEW runs AS
SELECT * FROM completed_runs
UNION ALL BY NAME
SELECT run, last_event AS status, started AS created_at FROM (
    SELECT run, arg_max(event, happened_at) AS last_event, min(happened_at) AS started
    FROM run_history GROUP BY run
) WHERE run NOT IN (SELECT run FROM completed_runs)
"""

# ``predictions``: every completed run's predictions (written by each rank for its own nodes, in
# the last layer), with the run's dataset version. ``current_predictions``: those of each
# pipeline's serving run (graphstore.promotion), next to the promoted model's run.
PREDICTION_VIEWS = """
CREATE OR REPLACE VIEW predictions AS
SELECT p.run, r.dataset, p.node_id, p.predicted, p.score, p.split, p.part
FROM prediction_rows p JOIN completed_runs r ON p.run = r.run;
CREATE OR REPLACE VIEW current_predictions AS
SELECT d.pipeline, d.promoted_run, p.run, p.dataset, p.node_id, p.predicted, p.score, p.split
FROM (
    SELECT pipeline, arg_max(serving_run, decided_at) AS run, arg_max(promoted_run, decided_at) AS promoted_run
    FROM promotions GROUP BY pipeline
) d JOIN predictions p ON p.run = d.run
"""


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def view_sql(store: Store, spec: ViewSpec) -> str:
    """``CREATE OR REPLACE VIEW`` for ``spec``: over the files if any exist, else an empty typed view."""
    if not any(store.root.glob(spec.pattern)):
        empty = ", ".join(f'CAST(NULL AS {typ}) AS "{name}"' for name, typ in spec.columns)
        return f"CREATE OR REPLACE VIEW {spec.name} AS SELECT {empty} WHERE false"
    glob = _sql_string(str(store.root / spec.pattern))
    if spec.source == "json":
        columns = ", ".join(f'"{name}": {_sql_string(typ)}' for name, typ in (spec.json_columns or spec.columns))
        # the files carry every column; hive detection would type a run=<all digits> folder as BIGINT
        reader = f"read_json({glob}, format = 'unstructured', hive_partitioning = false, columns = {{{columns}}})"
    else:
        reader = f"read_parquet({glob}, hive_partitioning = true, hive_types_autocast = false, union_by_name = true)"
    return f"CREATE OR REPLACE VIEW {spec.name} AS SELECT {spec.select} FROM {reader}"


@contextmanager
def connect(store: Store, read_only: bool, attempts: int = 50) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open the catalog, retrying while another process holds DuckDB's file lock."""
    for attempt in range(attempts):
        try:
            connection = duckdb.connect(str(store.catalog_path), read_only=read_only)
            break
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower() or attempt == attempts - 1:
                raise RetexoError(f"cannot open the catalog {store.catalog_path}: {exc}") from exc
            time.sleep(0.1)
    try:
        yield connection
    finally:
        connection.close()


def refresh_catalog(store: Store) -> None:
    """(Re)create every view."""
    with writer_lock(store, store.catalog_path), connect(store, read_only=False) as con:
        tables = con.execute("SELECT table_name FROM duckdb_tables() WHERE table_name = 'run_history'").fetchall()
        if tables:  # a store written before run history became files
            con.execute("DROP TABLE run_history")
        for spec in VIEWS:
            con.execute(view_sql(store, spec))
        con.execute(RUNS_VIEW)
        con.execute(PREDICTION_VIEWS)


ALLOWED_STATEMENTS = {
    duckdb.StatementType.SELECT,
    duckdb.StatementType.EXPLAIN,
}

# ``EXPLAIN [ANALYZE] [(options)]`` in front of the statement it explains (ANALYZE runs it).
_EXPLAIN_PREFIX = re.compile(r"^\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^)]*\)\s*)?", re.IGNORECASE)


class ReadOnlyViolation(RetexoError):
    """A statement given to ``retexo sql`` would change something."""


def _refuse(kind: str, text: str) -> ReadOnlyViolation:
    return ReadOnlyViolation(
        f"refused: `retexo sql` is read-only, and this is a statement of type {kind} "
        f"({text.strip()[:60]!r}); only SELECT queries (and EXPLAIN of them) are allowed"
    )


def _statements(sql: str) -> list[duckdb.Statement]:
    con = duckdb.connect()
    try:
        return con.extract_statements(sql)
    except duckdb.Error as exc:
        raise RetexoError(f"SQL does not parse: {exc}") from exc
    finally:
        con.close()


def check_read_only(sql: str) -> None:
    """Refuse anything but SELECT / EXPLAIN (CREATE, INSERT, DROP, COPY … TO, ATTACH, SET, …).

    An EXPLAIN is allowed only for a SELECT: ``EXPLAIN ANALYZE`` executes the statement it
    explains, so ``EXPLAIN ANALYZE COPY … TO`` would write a file.
    """
    statements = _statements(sql)
    if not statements:
        raise RetexoError("no SQL statement given")
    for statement in statements:
        if statement.type not in ALLOWED_STATEMENTS:
            raise _refuse(statement.type.name, statement.query)
        if statement.type == duckdb.StatementType.EXPLAIN:
            prefix = _EXPLAIN_PREFIX.match(statement.query)
            inner = _statements(statement.query[prefix.end():]) if prefix else []
            if len(inner) != 1 or inner[0].type != duckdb.StatementType.SELECT:
                kind = f"EXPLAIN {inner[0].type.name}" if len(inner) == 1 else "EXPLAIN"
                raise _refuse(kind, statement.query)


def query(store: Store, sql: str) -> tuple[list[str], list[tuple[object, ...]]]:
    """Run read-only SQL against the catalog (refreshed first); returns (column names, rows)."""
    check_read_only(sql)
    refresh_catalog(store)
    with connect(store, read_only=True) as con:
        try:
            result = con.execute(sql)
            columns = [d[0] for d in result.description or []]
            rows = result.fetchall()
        except duckdb.Error as exc:
            raise RetexoError(f"query failed: {exc}") from exc
    return columns, rows
