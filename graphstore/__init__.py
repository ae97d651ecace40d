"""The store: layout, Parquet I/O, fingerprints, manifests, atomic writes, locks, DuckDB catalog.

Everything the pipeline produces lives under one root directory in Hive-style ``key=value``
folders (README "The store", docs/architecture.md). This package never imports torch training code.
"""
