"""Exact evaluation from uneven shards: the shards, the gathers, the metrics.

- ``eval_sharding``: rank 0 decides the evaluation shards and scatters them.
- ``uneven_gather``: gathers of tensors whose shapes differ across ranks (layouts first).
- ``metric_sync``: exact torchmetrics from uneven shards, a few batched collectives per loader.

May import: nothing else of ``parallel``. Nothing is imported here.
"""
