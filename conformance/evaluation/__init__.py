"""Exact evaluation: the evaluation patterns users write, under one process, Lightning's ``ddp`` and ``custom_ddp``.

- ``patterns``: LightningModules and callbacks with the metrics, gathers and hooks users write.
- ``uneven``: a pattern with uneven data per rank.
- ``table``: ``python -m conformance.evaluation.table`` runs them and writes the record and the manual's table.

Nothing is imported here.
"""
