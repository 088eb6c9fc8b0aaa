"""The hand-written data-parallelism core of lit-cifar: pure torch, never imports Lightning.

Importing this package (or any module in it) loads torch (and torchmetrics for
``evaluation.metric_sync``) but not Lightning; ``tests/test_layout.py`` checks that in a fresh
interpreter. The Lightning adapters that plug these parts into a Trainer live in
:mod:`strategies`.

Rooms, one concern each (each sub-package's docstring lists its modules and what it may import):

- ``batchnorm``: SyncBatchNorm (the Function, its kernels, the module).
- ``gradients``: the gradient sync (buckets, reducer, ``SyncedDataParallel``) and ZeRO-1.
- ``host``: the shared-memory transport of one host's CPU ranks (buckets' sums, SyncBN's exchanges).
- ``evaluation``: exact evaluation from uneven shards (sharding, uneven gathers, metrics).
- ``uneven``: uneven data per rank (a loader that joins: empty batches once a rank's data ends).
- ``resume``: the rest of an interrupted epoch and every rank's random generators.
- Beside them: ``sync_config`` (the gradient-sync vocabulary: modes, default bucket caps), ``dist_utils``
  (small process-group helpers), ``torch_compat`` (what moved between torch 2.11 and later).

Nothing is imported here, so importing one module costs only that module.
"""
