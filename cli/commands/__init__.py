"""The commands of ``retexo``, one module per kind of work: ``ingest``, ``partition``, ``query``
(sql, report), ``store`` (ls, gc, verify), ``train`` (train, worker, site train) and ``pipeline``
(run). ``cli.app`` puts them together."""
