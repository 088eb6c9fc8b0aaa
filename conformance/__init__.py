"""Conformance of ``custom_ddp`` with what users write: evaluation patterns and the table generated from them.

- ``patterns``: LightningModules and callbacks with the metrics, gathers and hooks users write.
- ``table``: ``python -m conformance.table`` runs them under one process, Lightning's ``ddp`` and
  ``custom_ddp`` and writes ``conformance/results/`` and README.md's conformance table.

Entry points and test workloads, not an installed package; nothing is imported here.
"""
