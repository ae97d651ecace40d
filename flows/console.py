"""Terminal output for the CLI: tables, progress bars, error reporting."""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

out = Console()
err = Console(stderr=True)


def human_bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{value:.2f} TB"


def print_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table") -> None:
    """Print rows as a rich table, CSV or JSON (a list of objects)."""
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows(rows)
        sys.stdout.write(buffer.getvalue())
    elif fmt == "json":
        sys.stdout.write(json.dumps([dict(zip(columns, row)) for row in rows], default=str, indent=2) + "\n")
    else:
        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(str(column))
        for row in rows:
            table.add_row(*("" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value)) for value in row))
        out.print(table)


@contextmanager
def training_bars() -> Iterator[tuple[Callable[[Any], None], Callable[[Any], None]]]:
    """Yields ``(on_layer, on_round)`` for ``runner.lifecycle.run_training``: one bar per layer
    (``epochs`` for an end-to-end model) from rank 0's rounds, with the last val accuracy and the
    bytes all ranks have sent in this launch; a cached or reused layer is one finished line."""
    with Progress(
        TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(), TextColumn("val {task.fields[val]}"),
        TextColumn("{task.fields[sent]} sent"), TimeElapsedColumn(), console=err, transient=False,
    ) as bars:
        tasks: dict[int, Any] = {}
        totals: dict[int, int] = {}

        def bar(layer: int, total: int) -> Any:
            totals[layer] = total
            if layer not in tasks:
                tasks[layer] = bars.add_task(f"layer {layer}" if layer else "epochs", total=total, val="-", sent="-")
            return tasks[layer]

        def on_round(item: Any) -> None:
            val = "-" if item.val_acc is None else f"{item.val_acc:.3f}"
            bars.update(bar(item.layer, item.total), completed=item.done, total=item.total, val=val,
                        sent=human_bytes(item.bytes_sent))

        def on_layer(item: Any) -> None:
            if item.state != "trained" and item.layer not in tasks:
                bars.update(bar(item.layer, 1), completed=1, val=item.state, sent="-")
            elif item.layer in tasks:  # committed: full, even if its last round was not polled
                bars.update(tasks[item.layer], completed=totals[item.layer])

        yield on_layer, on_round


@contextmanager
def progress_bars() -> Iterator[Any]:
    """Yields a ``graphstore.progress.Progress`` callback drawing one bar per step name."""
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
