"""``retexo sql``: read-only SQL over the store's views, on a connection that can read the store and
nothing else.

``open_query`` refuses anything but ``SELECT`` (and ``EXPLAIN`` of one) before it runs
(``check_read_only``), refuses a store that holds a symbolic link (``refuse_links_out``), then
opens a fresh in-memory DuckDB connection, locks it down (``graphstore.catalog.lock_down``: only
files under the store root, no network, no extensions, a memory limit, configuration locked),
creates the views the query reads (``graphstore.catalog.create_views``) and runs the query under
a time limit (``connection.interrupt()`` from a timer). Its rows stream: fetched ``BATCH_ROWS`` at
a time, so a result of any length goes out in bounded memory (``query`` lists them, for small
results). It never opens ``catalog.duckdb``, so it neither waits for nor blocks a writer. Every
DuckDB error becomes one line (``_explain``).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb

from graphstore.catalog import (VIEW_NAMES, create_views, duckdb_reason, lock_down, named_store_file,
                                query_memory_limit, unreadable_file_message, with_dependencies)
from graphstore.errors import RetexoError, StoreError
from graphstore.layout import Store
from graphstore.units import human_bytes

DEFAULT_TIMEOUT_S = 60.0

ALLOWED_STATEMENTS = {
    duckdb.StatementType.SELECT,
    duckdb.StatementType.EXPLAIN,
}

# ``EXPLAIN [ANALYZE] [(options)]`` in front of the statement it explains (ANALYZE runs it).
_EXPLAIN_PREFIX = re.compile(r"^\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^)]*\)\s*)?", re.IGNORECASE)


class ReadOnlyViolation(RetexoError):
    """A statement given to ``retexo sql`` would change something."""


class OutsideStore(RetexoError):
    """A query tried to read something that is not in the store (a path, a URL, a link out)."""


class QueryTimeout(RetexoError):
    """A query ran past its time limit and was stopped."""


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
        raise RetexoError(f"SQL does not parse: {duckdb_reason(exc)}") from exc
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


def refuse_links_out(store: Store) -> None:
    """Refuse a store holding any symbolic link (the store's writers never make one).

    DuckDB resolves a link before checking a path against the store root, but it folds ``..``
    into the path first, as text: with ``a/up`` a link to the root itself (inside the store),
    ``<root>/a/up/../secret`` passes the check as ``<root>/a/secret`` and the system opens
    ``<root>/../secret``. A link to a folder outside would also let a glob list the names there.
    """
    pending = [store.root]
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        raise OutsideStore(
                            f"refused: `retexo sql` reads only the store {store.root}, and {entry.path} is a "
                            f"symbolic link (to {os.readlink(entry.path)}), through which a query could read "
                            f"outside it; remove the link (copy the data into the store instead)"
                        )
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
        except OSError as exc:
            raise OutsideStore(f"refused: cannot check {folder} for symbolic links: {exc.strerror}") from exc


def referenced_views(con: duckdb.DuckDBPyConnection, sql: str) -> set[str]:
    """The catalog views ``sql`` reads, with their dependencies; every view when none is named
    (``SELECT 1``, ``information_schema.tables``, ``SHOW TABLES``: listings show every view).

    DuckDB's ``get_table_names`` when it can tell (it cannot for ``JOIN … USING``), else every view
    whose name occurs in the text as a word (at worst a view too many is created). ``con`` must be
    locked down: ``get_table_names`` binds table functions, so it opens files and would install
    extensions.
    """
    found: set[str] = set()
    for statement in con.extract_statements(sql):
        try:
            found |= {name.lower() for name in con.get_table_names(statement.query)}
        except duckdb.InterruptException:
            raise
        except duckdb.Error:
            found |= {word.lower() for word in re.findall(r"\w+", statement.query)}
    return with_dependencies(found) or set(VIEW_NAMES)


def _explain(exc: duckdb.Error, store: Store, timed_out: bool, timeout: float) -> RetexoError:
    """One line for a DuckDB error: a refused path, the time limit, an unreadable file, or the query's fault."""
    message = str(exc)
    if isinstance(exc, duckdb.InterruptException):
        if timed_out:
            return QueryTimeout(f"the query was stopped at its time limit of {timeout:g} s; "
                                f"raise it with `retexo sql --timeout SECONDS`")
        return QueryTimeout("the query was interrupted")
    if isinstance(exc, duckdb.OutOfMemoryException):
        return RetexoError(f"the query needs more memory than `retexo sql` allows (half the available memory, "
                           f"{human_bytes(query_memory_limit())} now): select fewer rows or columns, or aggregate")
    if isinstance(exc, duckdb.PermissionException):
        path = re.search(r'Cannot access file "(.*)" - ', message)
        what = repr(path.group(1)) if path else duckdb_reason(exc)
        return OutsideStore(f"refused: `retexo sql` reads only the store {store.root}; {what} is outside it")
    unreadable = re.search(r"the store file .* cannot be read .*", message)
    if unreadable:  # an unreadable view was read
        return StoreError(unreadable.group(0).splitlines()[0])
    file = named_store_file(duckdb_reason(exc), store.root)
    if file is not None:  # damage found only while scanning (a page, not the footer)
        return StoreError(unreadable_file_message(file, duckdb_reason(exc)))
    return RetexoError(f"query failed: {duckdb_reason(exc)}")


def _missing_view(exc: duckdb.Error, created: set[str]) -> bool:
    """True when ``exc`` says a catalog view that was not created does not exist (SQL built at run time)."""
    found = re.search(r"Table with name (\w+) does not exist", str(exc))
    return found is not None and found.group(1).lower() in VIEW_NAMES and found.group(1).lower() not in created


BATCH_ROWS = 2048  # rows fetched from DuckDB at a time: what the caller holds of a result


@dataclass
class QueryResult:
    """A running query: its column names and its rows, fetched ``BATCH_ROWS`` at a time."""

    columns: list[str]
    _result: duckdb.DuckDBPyConnection
    _store: Store
    _expired: threading.Event
    _timeout: float

    def rows(self) -> Iterator[tuple[object, ...]]:
        """The rows in order; a DuckDB error while fetching becomes one line (``_explain``)."""
        while True:
            try:
                batch = self._result.fetchmany(BATCH_ROWS)
            except duckdb.Error as exc:
                raise _explain(exc, self._store, self._expired.is_set(), self._timeout) from exc
            if not batch:
                return
            yield from batch


@contextmanager
def _timed_connection(timeout: float) -> Iterator[tuple[duckdb.DuckDBPyConnection, threading.Event]]:
    """A fresh in-memory connection, interrupted (again and again) once ``timeout`` seconds have
    passed, closed on exit; yields it and the event that says the time ran out."""
    con = duckdb.connect(":memory:")
    expired, finished = threading.Event(), threading.Event()

    def stop() -> None:
        expired.set()
        while True:  # again and again: an interrupt between two statements would be lost
            con.interrupt()
            if finished.wait(0.05):
                return

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    try:
        yield con, expired
    finally:
        finished.set()
        timer.cancel()
        timer.join()
        con.close()


@contextmanager
def open_query(store: Store, sql: str, timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[QueryResult]:
    """Run read-only SQL over the store's views; yields the running query, whose rows stream.

    A fresh in-memory connection, locked down to the store root (``lock_down``: DuckDB holds at
    most ``query_memory_limit``), with the views the query reads; stopped after ``timeout``
    seconds (building the views and reading the rows included). The caller holds one batch of
    rows at a time, so a result of any length is written out in bounded memory.
    """
    check_read_only(sql)
    if not timeout > 0:
        raise RetexoError(f"--timeout must be a positive number of seconds, not {timeout:g}")
    refuse_links_out(store)
    every_view = False
    while True:
        with _timed_connection(timeout) as (con, expired):
            names: set[str] = set()
            try:
                lock_down(con, store.root)
                names = set(VIEW_NAMES) if every_view else referenced_views(con, sql)
                create_views(con, store, names)
                result = con.execute(sql)
            except duckdb.Error as exc:
                if not every_view and not expired.is_set() and _missing_view(exc, names):
                    every_view = True  # a view named only at run time (``query('FROM ' || ...)``)
                    continue
                raise _explain(exc, store, expired.is_set(), timeout) from exc
            yield QueryResult([d[0] for d in result.description or []], result, store, expired, timeout)
            return


def query(store: Store, sql: str, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[list[str], list[tuple[object, ...]]]:
    """``open_query`` with every row in a list: (column names, rows), for results known to be small."""
    with open_query(store, sql, timeout) as result:
        return result.columns, list(result.rows())
