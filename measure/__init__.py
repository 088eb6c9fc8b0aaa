"""Measurements, Lightning-free: what the callbacks record and the benchmarks time and report.

- ``timing``: per-rank micro-batch/step/epoch times (``StepTimer``), ``aligned_seconds``,
  ``slowest_rank``.
- ``memory``: per-rank peak memory (RSS sampling on CPU, the allocator's peak on CUDA).
- ``stats``: summaries and bootstrap confidence intervals (medians, ratios, differences, shares).
- ``run_info``: the environment of a record (CPU model, versions), the load of the machine
  (``wait_for_quiet``, ``Quietness``), a strategy's options, JSON conversion.
- ``collective_count``: every collective of a run from the torch profiler, by source.

Nothing is imported here; no module imports Lightning (``tests/test_layout.py`` checks it).
"""
