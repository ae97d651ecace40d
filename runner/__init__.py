"""The run lifecycle, between the entry points (CLI, Prefect tasks, benchmarks) and the training core.

``plan`` fingerprints a run and its layers, ``lifecycle`` brings every layer into the store
(cached, reused from another run, or trained in one process-group launch) and finalises the run,
``launch`` starts and watches the workers (processes, or threads for tests), ``worker`` is what
one rank runs, and ``results`` is the writer the workers store their outputs through. Nothing
else implements a lifecycle; ``retexo_core`` only trains.
"""
