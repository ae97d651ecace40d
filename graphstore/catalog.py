"""The DuckDB catalog: SQL views over the store's Parquet/JSON files, and the locked-down
connection settings (``lock_down``) every connection that reads them starts with.

Every view is built by one function, ``create_views``, in two places:

- ``graphstore.sql_query.query`` (``retexo sql``): a fresh in-memory connection per query, with
  only the views the query needs plus their dependencies.
- ``refresh_catalog`` (at the end of ingest / partition / train) writes the same views into a new
  DuckDB file next to ``catalog.duckdb`` and renames it into place, for users who open the catalog
  with the duckdb CLI or Python. Readers holding the old file keep it; nothing waits on a DuckDB lock.
  A failure there is logged, never raised: the data is already committed.

The views' paths are absolute (DuckDB resolves a relative path against the client's working
directory, not the database file's folder), and the catalog records the store root they start
with (table ``catalog_info``). A store copied, moved or mounted elsewhere is found by the next
``retexo`` command that opens it (``refresh_if_moved``), which rewrites the catalog for its new root.

A view is built over the list of files that exist when it is created (hidden names such as
writers' ``.tmp-*`` excluded), so the catalog file shows the files of its last refresh. A view
with no file is an empty view with the same columns, so users' SQL never breaks on an empty
store. A file that cannot be read (Parquet footer or schema, malformed manifest JSON) makes its
view an *unreadable* view: same columns, and reading it fails with one line naming the file, so
corruption in one place breaks only the queries that read it. Run history is files too
(``graphstore.history``), so the catalog holds views only (and ``catalog_info``). Column names are
a contract: add, never rename.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from graphstore.atomic import fsync_file, temp_sibling, writer_lock
from graphstore.errors import RetexoError, StoreError
from graphstore.layout import Store
from graphstore.limits import available_memory

log = logging.getLogger(__name__)

MIN_QUERY_MEMORY = 256 * 2**20  # bytes: the smallest memory limit of a query
REPAIR_HINT = "run `retexo store verify --repair`"


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
    optional: tuple[tuple[str, str], ...] = ()  # file columns added later: NULL where no file has them


def _cols(spec: str) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(item.split()) for item in spec.split(","))  # type: ignore[misc]


# a link partition's stats per part: its evaluation pairs, and those whose source another part owns
PAIR_STATS = _cols("val_positive_pairs BIGINT, val_negative_pairs BIGINT, test_positive_pairs BIGINT, "
                   "test_negative_pairs BIGINT, remote_src_pairs BIGINT")

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
        "train, val, test, balance, " + ", ".join(name for name, _ in PAIR_STATS),
        _cols("partition VARCHAR, part INTEGER, owned_nodes BIGINT, local_edges BIGINT, cut_edges BIGINT, "
              "halo_nodes BIGINT, train BIGINT, val BIGINT, test BIGINT, balance DOUBLE") + PAIR_STATS,
        optional=PAIR_STATS,
    ),
    ViewSpec(
        "completed_runs", "json", "runs/run=*/manifest.json",
        "fp AS run, dataset, partition, strategy, model, setting, test_acc, val_acc, total_bytes, sim_comm_s, "
        "wall_s, status, dataset_name, label, method, parts, created_at, platform",
        _cols("run VARCHAR, dataset VARCHAR, partition VARCHAR, strategy VARCHAR, model VARCHAR, setting VARCHAR, "
              "test_acc DOUBLE, val_acc DOUBLE, total_bytes BIGINT, sim_comm_s DOUBLE, wall_s DOUBLE, status VARCHAR, "
              "dataset_name VARCHAR, label VARCHAR, method VARCHAR, parts BIGINT, created_at TIMESTAMP, platform VARCHAR"),
        _cols("fp VARCHAR, dataset VARCHAR, partition VARCHAR, strategy VARCHAR, model VARCHAR, setting VARCHAR, "
              "test_acc DOUBLE, val_acc DOUBLE, total_bytes BIGINT, sim_comm_s DOUBLE, wall_s DOUBLE, status VARCHAR, "
              "dataset_name VARCHAR, label VARCHAR, method VARCHAR, parts BIGINT, created_at TIMESTAMP, platform VARCHAR"),
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
        "run, split, accuracy, macro_f1, roc_auc, nodes, mrr, hits_at_k, k, pairs",
        _cols("run VARCHAR, split VARCHAR, accuracy DOUBLE, macro_f1 DOUBLE, roc_auc DOUBLE, nodes BIGINT, "
              "mrr DOUBLE, hits_at_k DOUBLE, k BIGINT, pairs BIGINT"),
        optional=_cols("mrr DOUBLE, hits_at_k DOUBLE, k BIGINT, pairs BIGINT"),
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
        "link_scores", "parquet", "runs/run=*/layer=*/part=*/link_scores.parquet",
        "run, CAST(part AS INTEGER) AS part, src, dst, score, label, split",
        _cols("run VARCHAR, part INTEGER, src BIGINT, dst BIGINT, score FLOAT, label TINYINT, split VARCHAR"),
    ),
    ViewSpec(
        "recommendations", "parquet", "runs/run=*/layer=*/part=*/recommendations.parquet",
        "run, CAST(part AS INTEGER) AS part, node_id, candidate, score, rank",
        _cols("run VARCHAR, part INTEGER, node_id BIGINT, candidate BIGINT, score FLOAT, rank INTEGER"),
    ),
    ViewSpec(
        "link_pairs", "parquet", "datasets/name=*/fp=*/link_pairs.parquet",
        "fp AS dataset, src, dst, label, split",
        _cols("dataset VARCHAR, src BIGINT, dst BIGINT, label TINYINT, split VARCHAR"),
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

# Views over other views: name -> (the views they read, their SQL).
# ``runs``: completed runs (from their manifests) plus runs that only have history so far
# (started / failed), with the latest event as their status.
# ``predictions``: every completed run's predictions (written by each rank for its own nodes, in
# the last layer), with the run's dataset version. ``current_predictions``: those of each
# pipeline's serving run (graphstore.promotion), next to the promoted model's run.
DERIVED_VIEWS: dict[str, tuple[tuple[str, ...], str]] = {
    "runs": (("completed_runs", "run_history"), """
CREATE OR REPLACE VIEW runs AS
SELECT * FROM completed_runs
UNION ALL BY NAME
SELECT run, last_event AS status, started AS created_at FROM (
    SELECT run, arg_max(event, happened_at) AS last_event, min(happened_at) AS started
    FROM run_history GROUP BY run
) WHERE run NOT IN (SELECT run FROM completed_runs)
"""),
    "predictions": (("prediction_rows", "completed_runs"), """
CREATE OR REPLACE VIEW predictions AS
SELECT p.run, r.dataset, p.node_id, p.predicted, p.score, p.split, p.part
FROM prediction_rows p JOIN completed_runs r ON p.run = r.run
"""),
    "current_predictions": (("promotions", "predictions"), """
CREATE OR REPLACE VIEW current_predictions AS
SELECT d.pipeline, d.promoted_run, p.run, p.dataset, p.node_id, p.predicted, p.score, p.split
FROM (
    SELECT pipeline, arg_max(serving_run, decided_at) AS run, arg_max(promoted_run, decided_at) AS promoted_run
    FROM promotions GROUP BY pipeline
) d JOIN predictions p ON p.run = d.run
"""),
}

VIEW_NAMES: tuple[str, ...] = (*(spec.name for spec in VIEWS), *DERIVED_VIEWS)


# --------------------------------------------------------------------------- building views


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def view_files(store: Store, spec: ViewSpec) -> list[Path]:
    """The files of ``spec`` now, sorted; hidden names (writers' ``.tmp-*`` files) are not the store's."""
    return sorted(
        path for path in store.root.glob(spec.pattern)
        if not any(part.startswith(".") for part in path.relative_to(store.root).parts)
    )


def view_sql(spec: ViewSpec, files: Sequence[Path]) -> str:
    """``CREATE OR REPLACE VIEW`` for ``spec`` over ``files``, or an empty typed view when there is none."""
    if not files:
        empty = ", ".join(f'CAST(NULL AS {typ}) AS "{name}"' for name, typ in spec.columns)
        return f"CREATE OR REPLACE VIEW {spec.name} AS SELECT {empty} WHERE false"
    paths = "[" + ", ".join(_sql_string(str(path)) for path in files) + "]"
    if spec.source == "json":
        columns = ", ".join(f'"{name}": {_sql_string(typ)}' for name, typ in (spec.json_columns or spec.columns))
        # the files carry every column; hive detection would type a run=<all digits> folder as BIGINT
        reader = f"read_json({paths}, format = 'unstructured', hive_partitioning = false, columns = {{{columns}}})"
    else:
        reader = f"read_parquet({paths}, hive_partitioning = true, hive_types_autocast = false, union_by_name = true)"
        if spec.optional:
            nulls = ", ".join(f'CAST(NULL AS {typ}) AS "{name}"' for name, typ in spec.optional)
            reader = f"(SELECT * FROM {reader} UNION ALL BY NAME SELECT {nulls} WHERE false)"
    return f"CREATE OR REPLACE VIEW {spec.name} AS SELECT {spec.select} FROM {reader}"


def unreadable_view_sql(spec: ViewSpec, problem: str) -> str:
    """A view with ``spec``'s columns whose every read fails with ``problem`` (DuckDB's ``error()``)."""
    columns = ", ".join(f'CAST(NULL AS {typ}) AS "{name}"' for name, typ in spec.columns)
    fail = f"error({_sql_string(problem)})"
    return f"CREATE OR REPLACE VIEW {spec.name} AS SELECT {columns} FROM range(1) WHERE {fail}"


def duckdb_reason(exc: duckdb.Error) -> str:
    """DuckDB's message on one line, without its error-type prefix and the SQL excerpt."""
    text = str(exc).split("\n\nLINE ")[0]
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return re.sub(r"^[A-Za-z ]*Error: ", "", text)


def named_store_file(reason: str, root: Path) -> str | None:
    """The store file an error's reason (``duckdb_reason``: not the SQL excerpt) names, if any."""
    found = re.search(re.escape(str(root)) + r"/[^'\"\s]+", reason)
    return found.group(0) if found else None


def unreadable_file_message(file: str, reason: str, view: str | None = None) -> str:
    """The one line for a store file DuckDB cannot read (the path is not repeated in the reason)."""
    reason = re.sub(r"\s*['\"]?" + re.escape(file) + r"['\"]?", "", reason).rstrip(" .")
    where = f" (view {view})" if view else ""
    return f"the store file {file} cannot be read{where}: {reason}; {REPAIR_HINT}"


def _check_view(con: duckdb.DuckDBPyConnection, store: Store, spec: ViewSpec, files: list[Path]) -> str | None:
    """Create ``spec``'s view over ``files``; ``None`` when every file is readable, else the problem.

    Parquet footers and schemas are read by CREATE VIEW (``union_by_name``); JSON files are parsed
    by counting their records. When DuckDB's message names no file, each file is tried alone.
    """
    try:
        con.execute(view_sql(spec, files))
        if spec.source == "json" and files:
            con.execute(f"SELECT count(*) FROM {spec.name}").fetchall()
        return None
    except duckdb.InterruptException:
        raise
    except duckdb.Error as exc:
        reason = duckdb_reason(exc)
    file = named_store_file(reason, store.root)
    if file is None:
        for path in files:
            try:
                con.execute(view_sql(spec, [path]))
                con.execute(f"SELECT count(*) FROM {spec.name}").fetchall()
            except duckdb.InterruptException:
                raise
            except duckdb.Error:
                file = str(path)
                break
    return unreadable_file_message(file or str(store.root / spec.pattern), reason, spec.name)


def with_dependencies(names: Iterable[str]) -> set[str]:
    """``names`` plus every view they read (``runs`` reads ``completed_runs`` and ``run_history``, ...)."""
    found: set[str] = set()
    pending = [name for name in names if name in VIEW_NAMES]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending.extend(DERIVED_VIEWS.get(name, ((), ""))[0])
    return found


def create_views(con: duckdb.DuckDBPyConnection, store: Store, names: Iterable[str] = VIEW_NAMES) -> dict[str, str]:
    """Create the views ``names`` and those they read; returns {view: problem} for unreadable ones.

    An unreadable view keeps its columns and fails when read, naming the file; creating it never fails.
    """
    wanted = with_dependencies(names)
    problems: dict[str, str] = {}
    for spec in VIEWS:
        if spec.name in wanted:
            problem = _check_view(con, store, spec, view_files(store, spec))
            if problem is not None:
                con.execute(unreadable_view_sql(spec, problem))
                problems[spec.name] = problem
    for name, (_reads, sql) in DERIVED_VIEWS.items():
        if name in wanted:
            con.execute(sql)
    return problems


def query_memory_limit() -> int:
    """Bytes a query may hold: half the memory available now (at least ``MIN_QUERY_MEMORY``)."""
    return max(MIN_QUERY_MEMORY, available_memory() // 2)


def lock_down(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Let ``con`` read files under ``root`` and nothing else, then lock its configuration.

    DuckDB checks every file path against ``allowed_directories`` (after folding ``..`` as text and
    resolving symbolic links: see ``refuse_links_out``) and refuses other paths, and every URL (no
    network), once external access is off; ``allowed_directories`` can only be set before that.
    No temp directory (DuckDB would allow reading it too; queries cannot spill to disk), so a query
    is held to ``query_memory_limit``; no Python replacement scans (DataFrames of the caller by
    name), no extension install or load, no progress bar on the console.
    """
    for setting in (
        f"SET memory_limit = '{query_memory_limit() // 2**20}MiB'",
        "SET enable_progress_bar = false",
        "SET temp_directory = ''",
        "SET python_enable_replacements = false",
        f"SET allowed_directories = [{_sql_string(str(root) + os.sep)}]",
        "SET autoinstall_known_extensions = false",
        "SET autoload_known_extensions = false",
        "SET enable_external_access = false",
        "SET lock_configuration = true",
    ):
        con.execute(setting)


# --------------------------------------------------------------------------- the persistent catalog


CATALOG_INFO = "catalog_info"  # the catalog's one table: the store root its views were written for


def write_catalog(store: Store) -> None:
    """Write every view into a new ``catalog.duckdb`` (a temp file renamed into place), with the
    store root the views' paths start with in its table ``catalog_info`` (``store_root``).

    Raises ``duckdb.Error``, ``OSError`` or ``RetexoError`` (nothing is replaced then).
    """
    temp = temp_sibling(store.catalog_path)
    temp_wal = temp.with_name(temp.name + ".wal")
    try:
        with writer_lock(store, store.catalog_path):
            con = duckdb.connect(str(temp))
            try:
                lock_down(con, store.root)
                for view, problem in create_views(con, store).items():
                    log.warning("catalog view %s is unreadable: %s", view, problem)
                con.execute(f"CREATE TABLE {CATALOG_INFO} AS SELECT {_sql_string(str(store.root))} AS store_root")
                con.execute("CHECKPOINT")
            finally:
                con.close()
            temp_wal.unlink(missing_ok=True)  # checkpointed: the file holds everything
            fsync_file(temp)
            # a WAL left by an earlier catalog file must not be replayed onto the new one
            store.catalog_path.with_name(store.catalog_path.name + ".wal").unlink(missing_ok=True)
            os.replace(temp, store.catalog_path)
            fsync_file(store.root)
    finally:
        temp.unlink(missing_ok=True)
        temp_wal.unlink(missing_ok=True)


def _reason(exc: Exception) -> str:
    return duckdb_reason(exc) if isinstance(exc, duckdb.Error) else str(exc)


def refresh_catalog(store: Store) -> None:
    """``write_catalog``, never raising: a writer calls this after its data is committed, and the
    catalog is only a convenience for the duckdb CLI (``retexo sql`` builds its views itself).
    Problems are logged.
    """
    try:
        write_catalog(store)
    except (duckdb.Error, OSError, RetexoError) as exc:
        log.warning("the catalog %s was not refreshed (%s); `retexo sql` does not need it", store.catalog_path,
                    _reason(exc))


def catalog_store_root(store: Store) -> str | None:
    """The store root ``catalog.duckdb`` was written for: ``""`` for a catalog written before it was
    recorded, None when there is no catalog or it cannot be opened now (another process holds it)."""
    if not store.catalog_path.is_file():
        return None
    try:
        con = duckdb.connect(str(store.catalog_path), read_only=True)
    except duckdb.Error:
        return None
    try:
        lock_down(con, store.root)
        rows = con.execute(f"SELECT store_root FROM {CATALOG_INFO}").fetchall()
        return str(rows[0][0]) if rows else ""
    except duckdb.CatalogException:
        return ""
    except duckdb.Error:
        return None
    finally:
        con.close()


@dataclass(frozen=True)
class CatalogMove:
    """The catalog named another store root (the store was copied, moved or mounted elsewhere)."""

    old_root: str
    problem: str | None  # why it could not be rewritten for the store's root now; None: it was

    def message(self, root: Path) -> str:
        if self.problem is None:
            return f"catalog.duckdb was written for the store at {self.old_root}; its views now read {root}"
        return (f"catalog.duckdb was written for the store at {self.old_root} and could not be rewritten for "
                f"{root} ({self.problem}); `retexo sql` does not need it")


def refresh_if_moved(store: Store) -> CatalogMove | None:
    """Rewrite ``catalog.duckdb`` when its views read another store root than ``store.root``: the
    views hold absolute paths, which DuckDB resolves the same way from any client and working
    directory (a relative path would be resolved against the client's working directory, not the
    database file's folder). None when there is nothing to do."""
    old_root = catalog_store_root(store)
    if old_root is None or old_root == str(store.root):
        return None
    if not old_root:  # written before the catalog recorded its root: rewritten once, quietly
        refresh_catalog(store)
        return None
    try:
        write_catalog(store)
        return CatalogMove(old_root, None)
    except (duckdb.Error, OSError, RetexoError) as exc:
        return CatalogMove(old_root, _reason(exc))
