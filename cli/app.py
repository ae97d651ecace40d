"""The ``retexo`` command tree and its entry point (``main``, the console script).

The data commands (ingest, partition, sql, report, store) are in the tree as soon as this module is
imported, and import no training core. The training commands (train, worker, run, site train)
join in ``main``: their options are derived from ``TrainConfig`` and so import ``retexo_core``
(and they import the run lifecycle when they run)."""

from __future__ import annotations

import logging
import os

import typer

from cli.commands.ingest import ingest_app
from cli.commands.partition import partition_cmd
from cli.commands.query import report_cmd, sql_cmd
from cli.commands.store import store_app
from cli.errors import failures_in_one_line

LOG_LEVEL_ENV = "RETEXO_LOG_LEVEL"

app = typer.Typer(
    help="Communication-efficient distributed GNN training: ingest, partition, train, inspect with SQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(ingest_app, name="ingest")
app.add_typer(store_app, name="store")
app.command("partition")(partition_cmd)
app.command("sql")(sql_cmd)
app.command("report")(report_cmd)


def add_training_commands(tree: typer.Typer) -> None:
    """``train``, ``worker``, ``run`` and ``site`` (train, provision, revoke; see the module docstring)."""
    from cli.commands.pipeline import run_cmd
    from cli.commands.site_keys import provision_cmd, revoke_cmd
    from cli.commands.train import site_app, train_cmd, worker_cmd

    site_app.command("provision")(provision_cmd)
    site_app.command("revoke")(revoke_cmd)

    tree.command("train")(train_cmd)
    tree.command("worker")(worker_cmd)
    tree.command("run")(run_cmd)
    tree.add_typer(site_app, name="site")


def log_to_stderr() -> None:
    """Log records at ``$RETEXO_LOG_LEVEL`` (default WARNING) and above to stderr, also those of
    loggers with a level of their own (Prefect's INFO: their records still reach the Prefect API)."""
    level = os.environ.get(LOG_LEVEL_ENV, "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setLevel(level)


def main() -> None:
    """``retexo``: every command; a failure a user can act on is one line (``cli.errors``)."""
    log_to_stderr()
    add_training_commands(app)
    with failures_in_one_line():
        app()
