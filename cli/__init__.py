"""The ``retexo`` command line: typer commands over the store (``graphstore``), the run lifecycle
(``runner``) and the Prefect flows (``flows``), with the terminal output they draw.

``cli.app`` builds the command tree and is the console script's entry point (``python -m cli``
runs it too); ``cli.commands`` holds one module per kind of work; ``cli.options`` derives the
options from the pydantic models that declare them; ``cli.console`` draws tables and progress;
``cli.prefect_runtime`` runs a flow in the command's own process (``retexo run``). Nothing below
``cli`` imports it: flows, tasks and the runner report progress through callbacks they are handed.
"""
