"""What ``custom_ddp`` promises users, checked from real runs: exact evaluation and no hang.

- ``patterns``: LightningModules and callbacks with the metrics, gathers and hooks users write.
- ``table``: ``python -m conformance.table`` runs them under one process, Lightning's ``ddp`` and
  ``custom_ddp`` and writes ``conformance/results/evaluation/`` and the conformance table of ``docs/evaluation.md``.
- ``fault_fit``, ``fault_matrix``, ``fault_matrix_report``: ``python -m conformance.fault_matrix``
  sends signals, kills and faults to a 2-rank fit and times how every rank ends
  (``conformance/results/fault_matrix/`` and the fault table of ``docs/stopping-and-resuming.md``).

Entry points and test workloads, not an installed package; nothing is imported here.
"""
