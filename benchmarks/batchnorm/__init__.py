"""The hand-written SyncBatchNorm, measured.

- ``syncbn``: ``python -m benchmarks.batchnorm.syncbn``: one layer's forward+backward time and peak memory against
  local BN plus its all-reduces (CPU) or torch's SyncBatchNorm Function (CUDA); the kernel alone on one rank.
- ``syncbn_report``: that record's analysis, headline and report.
- ``syncbn_profile``: ``python -m benchmarks.batchnorm.syncbn_profile``: where one layer call's time goes on a GPU (the
  host's share of it, torch.profiler's tables); no target.
- ``syncbn_lockstep``: ``python -m benchmarks.batchnorm.syncbn_lockstep``: where SyncBatchNorm's cost goes in a
  2-rank training step (kernel, exchange, lockstep).

Nothing is imported here.
"""
