"""Prefect flows, one module per stage (``ingest``, ``partition``, ``train``) and the whole
``pipeline``, with their parameter models (``params``). Flows call ``tasks``; the command line
(``cli``) calls flows."""
