"""Terminal output for the CLI: tables, progress bars, error reporting.

On a terminal, tables fold a value that does not fit (never cut it) and progress is drawn as
bars. When stdout or stderr is not a terminal (a pipe, a file, cron, CI) that console has no width
limit, so a table keeps every value whole on its line and text is never wrapped, and progress
becomes a few log lines on stderr (``ProgressLines``): a step's start, every tenth of it, its end.
"""

from __future__ import annotations

import csv
import json
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from graphstore.units import human_bytes

UNBOUNDED_WIDTH = 1_000_000  # columns of a console that is not a terminal: no value is cut or wrapped
TABLE_ROWS = 1000  # rows at most in a table of query results (csv and json stream every row)


def _console(stderr: bool) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.size = (UNBOUNDED_WIDTH, 25)
        console.soft_wrap = True
    return console


out = _console(stderr=False)
err = _console(stderr=True)


def _cell(value: Any) -> str:
    return "" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], fmt: str = "table") -> None:
    """Print rows as a rich table, CSV or JSON (a list of objects).

    CSV and JSON are written as the rows come (``rows`` may be a stream of any length); a table
    must be held whole to be laid out, so it shows at most ``TABLE_ROWS`` rows and then says on
    stderr that more rows were left out.
    """
    if fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    elif fmt == "json":
        first = True
        for row in rows:
            item = json.dumps(dict(zip(columns, row)), default=str, indent=2)
            sys.stdout.write(("[\n" if first else ",\n") + textwrap.indent(item, "  "))
            first = False
        sys.stdout.write("[]\n" if first else "\n]\n")
    else:
        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(str(column), overflow="fold")
        shown = 0
        for row in rows:
            if shown == TABLE_ROWS:
                err.print(f"only the first {TABLE_ROWS} rows are shown; --format csv or json prints every row",
                          highlight=False)
                break
            table.add_row(*map(_cell, row))
            shown += 1
        out.print(table)


class ProgressLines:
    """Which progress reports become log lines when stderr is not a terminal: the first of a step,
    its last, and in between the first of each further tenth of its total that comes at least
    ``every_s`` after the step's previous line (a step of a second is two lines)."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.tenths: dict[object, int] = {}
        self.started: dict[object, float] = {}
        self.shown: dict[object, float] = {}

    def due(self, step: object, done: int, total: int) -> bool:
        now, tenth = time.perf_counter(), 10 * done // total if total > 0 else 10
        if step in self.tenths and (tenth <= self.tenths[step] or
                                    (tenth < 10 and now - self.shown[step] < self.every_s)):
            return False
        self.tenths[step], self.shown[step] = tenth, now
        self.started.setdefault(step, now)
        return True

    def elapsed(self, step: object) -> str:
        return f"{time.perf_counter() - self.started.get(step, time.perf_counter()):.1f} s"


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


@contextmanager
def training_bars() -> Iterator[tuple[Callable[[Any], None], Callable[[Any], None]]]:
    """Yields ``(on_layer, on_round)`` for ``runner.lifecycle.run_training``: one bar per layer
    (``epochs`` for an end-to-end model) from rank 0's rounds, with the best val accuracy so far
    (the model the layer keeps), the last one, and the bytes all ranks have sent in this launch; a
    cached or reused layer is one finished line. Not on a terminal: log lines (``ProgressLines``)."""
    if not err.is_terminal:
        yield _training_lines()
        return
    with Progress(
        TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("best val {task.fields[best]} (last {task.fields[val]})"),
        TextColumn("{task.fields[sent]} sent"), TimeElapsedColumn(), console=err, transient=False,
    ) as bars:
        tasks: dict[tuple[int | None, int], Any] = {}  # (depth, layer) -> its bar
        totals: dict[tuple[int | None, int], int] = {}

        def bar(item: Any, total: int) -> Any:
            key = (item.depth, item.layer)
            totals[key] = total
            if key not in tasks:
                tasks[key] = bars.add_task(_step(item), total=total, val="-", best="-", sent="-")
            return tasks[key]

        def on_round(item: Any) -> None:
            bars.update(bar(item, item.total), completed=item.done, total=item.total, val=_accuracy(item.val_acc),
                        best=_accuracy(item.best_val_acc), sent=human_bytes(item.bytes_sent))

        def on_layer(item: Any) -> None:
            key = (item.depth, item.layer)
            if item.state != "trained" and key not in tasks:
                bars.update(bar(item, 1), completed=1, best=item.state, val="-", sent="-")
            elif key in tasks:  # committed: full, even if its last round was not polled
                bars.update(tasks[key], completed=totals[key])

        yield on_layer, on_round


def _step(item: Any) -> str:
    """A bar's name: ``layer 2`` or ``epochs`` (an end-to-end model), with ``/3`` in a depth choice
    (of the depth-3 run), so that the two runs' steps differ."""
    return (f"layer {item.layer}" if item.layer else "epochs") + (f"/{item.depth}" if item.depth else "")


def _training_lines() -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """``training_bars`` as log lines: a layer's first round, every tenth of its rounds, its commit."""
    lines, last = ProgressLines(), {}

    def on_round(item: Any) -> None:
        last[(item.depth, item.layer)] = item
        if lines.due(_step(item), item.done, item.total):
            err.print(f"{_step(item)}: {item.done}/{item.total}, best val {_accuracy(item.best_val_acc)} "
                      f"(last {_accuracy(item.val_acc)}), {human_bytes(item.bytes_sent)} sent, "
                      f"{lines.elapsed(_step(item))}", highlight=False)

    def on_layer(item: Any) -> None:
        if item.state != "trained":
            err.print(f"{_step(item)}: {item.state}", highlight=False)
            return
        seen = last.get((item.depth, item.layer), last.get((item.depth, 0)))  # an end-to-end model's layers: its epochs
        kept = f", keeps the model of best val {_accuracy(seen.best_val_acc)}" if seen is not None else ""
        err.print(f"{_step(item)}: trained in {item.seconds:.1f} s{kept}", highlight=False)

    return on_layer, on_round


@contextmanager
def progress_bars() -> Iterator[Any]:
    """Yields a ``graphstore.progress.Progress`` callback drawing one bar per step name (log lines
    when stderr is not a terminal: ``ProgressLines``)."""
    if not err.is_terminal:
        lines = ProgressLines()

        def log_line(step: str, done: int, total: int) -> None:
            if lines.due(step, done, total):
                err.print(f"{step}: {done}/{total}, {lines.elapsed(step)}", highlight=False)

        yield log_line
        return
    with Progress(
        TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=False,
    ) as bars:
        tasks: dict[str, Any] = {}

        def report(step: str, done: int, total: int) -> None:
            if step not in tasks:
                tasks[step] = bars.add_task(step, total=total)
            bars.update(tasks[step], completed=done, total=total)

        yield report
