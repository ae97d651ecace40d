"""``retexo sql`` and ``retexo report``: read the store, a query over its views or a run's report."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.console import out, print_table
from cli.shared_options import StoreOption, open_store
from graphstore.errors import RetexoError
from graphstore.sql_query import DEFAULT_TIMEOUT_S, open_query


def sql_cmd(
    statement: Annotated[str, typer.Argument(help="A SELECT query over the catalog views (datasets, nodes, edges, partitions, ...).")],
    format: Annotated[str, typer.Option("--format", help="table | csv | json.")] = "table",
    timeout: Annotated[float, typer.Option("--timeout", help="Stop the query after this many seconds.")] = DEFAULT_TIMEOUT_S,
    store: StoreOption = None,
) -> None:
    """Run a read-only SQL query over the store's views; it can read the store's files and nothing else.

    CSV and JSON stream every row of the result as DuckDB produces it (the process holds one batch
    of rows at a time); a table shows the first 1000 rows. The time limit covers the whole output."""
    if format not in ("table", "csv", "json"):
        raise RetexoError(f"--format must be table, csv or json, not '{format}'")
    with open_query(open_store(store), statement, timeout) as result:
        print_table(None, result.columns, result.rows(), format)


def report_cmd(
    run: Annotated[str, typer.Argument(help="Run fingerprint (or a unique prefix).")],
    store: StoreOption = None,
) -> None:
    """Regenerate a run's markdown report and accuracy-vs-bytes plot; prints the PNG's path."""
    from graphstore.report import write_report

    report = write_report(open_store(store), run)
    out.print(report.markdown, markup=False, highlight=False)
    typer.echo(str(report.plot_path))
