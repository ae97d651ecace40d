"""The options several commands share (``--store``, ``--force``), and the store a command opens
from ``--store``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.console import err
from graphstore.catalog import refresh_if_moved
from graphstore.layout import STORE_ENV, Store

StoreOption = Annotated[
    Optional[Path],
    typer.Option("--store", envvar=STORE_ENV, help="Store root directory (default ./retexo-store; env RETEXO_STORE)."),
]
ForceOption = Annotated[bool, typer.Option("--force", help="Go on even when the memory estimate exceeds the memory available now.")]

OPENED_STORES: list[Path] = []  # the roots this command opened, named by an OS error without a file name


def open_store(path: Path | None) -> Store:
    """The store at ``path`` (or $RETEXO_STORE, or ./retexo-store). When it was copied, moved or
    mounted elsewhere, its ``catalog.duckdb`` is rewritten for its path now, and one line says so."""
    store = Store.open(path)
    OPENED_STORES.append(store.root)
    moved = refresh_if_moved(store)
    if moved is not None:
        err.print(moved.message(store.root), highlight=False)
    return store
