"""The hand-written data-parallelism core of lit-cifar: pure torch, never imports Lightning.

Importing this package (or any module in it) loads torch (and torchmetrics for
``metric_sync``) but not Lightning; ``tests/test_layout.py`` checks that in a fresh
interpreter. The Lightning adapters that plug these parts into a Trainer live in
:mod:`strategies`.

Modules, one concern each:

- ``sync_config``: the gradient-sync vocabulary (modes, default bucket caps), in one place.
- ``dist_utils``: small process-group helpers shared by the modules below; ``torch_compat``: what moved
  between the supported torch releases (2.11 and later).
- ``syncbn_function``, ``syncbn``: SyncBatchNorm as an autograd Function (one collective
  forward, one backward) and its ``BatchNorm*d`` drop-in module; ``syncbn_kernels``: its passes
  over x-sized memory, eager (the reference) or compiled with ``torch.compile``.
- ``buckets``, ``grad_sync``: flat gradient buckets and ``SyncedDataParallel`` (bucketed
  all-reduce overlapped with backward, ``no_sync()`` for accumulation).
- ``zero``: ``ShardedOptimizer`` (ZeRO-1).
- ``eval_sharding``: rank 0 decides evaluation shards and scatters them.
- ``resume_sampler``: the rest of an interrupted epoch, in the sampler's own order.
- ``uneven_gather``: gathers of tensors whose shapes differ across ranks (layouts first).
- ``metric_sync``: exact torchmetrics from uneven shards, a few batched collectives per loader.

Nothing is imported here, so importing one module costs only that module.
"""
