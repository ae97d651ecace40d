"""The store: layout, Parquet I/O, fingerprints, manifests, atomic writes, locks, DuckDB catalog.

Everything the pipeline produces lives under one root directory in Hive-style ``key=value``
folders (docs/store.md, docs/architecture.md). This package never imports torch training code.
"""
