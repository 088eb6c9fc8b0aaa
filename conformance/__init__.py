"""What ``custom_ddp`` promises users, checked from real runs against Lightning's ``ddp`` and a single process.

One room per promise:

- ``evaluation/``: exact evaluation. The evaluation patterns users write (metrics, gathers, hooks) under one
  process, ``ddp`` and ``custom_ddp``: ``python -m conformance.evaluation.table`` writes
  ``conformance/results/evaluation/`` and the table of ``docs/evaluation.md``.
- ``training/``: every gradient, buffer and parameter. The training patterns users write against their truth:
  ``python -m conformance.training.table`` writes ``conformance/results/training/`` and the table of
  ``docs/training-conformance.md``.
- ``faults/``: never hangs, never loses work. ``python -m conformance.faults.matrix`` sends signals, kills and
  faults to a 2-rank fit and times how every rank ends (``conformance/results/fault_matrix/`` and the fault
  table of ``docs/stopping-and-resuming.md``).
- ``lightning_suite/``: a drop-in for ``ddp``. Lightning's own tests, run with its ``ddp`` names resolved to
  ``custom_ddp``.

Entry points and test workloads, not an installed package; nothing is imported here. A room may import the
project's packages and, where it shares a helper, another room's module by its full name.
"""
