"""Communication, measured: the hand-written all-reduces and the gradient synchronisation modes.

- ``allreduce``: ``python -m benchmarks.collectives.allreduce``: ring and butterfly against ``dist.all_reduce``,
  and gloo's bandwidth.
- ``allreduce_report``: that record's analysis, headline and report.
- ``grad_sync``: ``python -m benchmarks.collectives.grad_sync``: per-parameter, flat and bucketed modes against
  torch DDP, plus ZeRO-1.
- ``grad_sync_report``: that record's analysis and report.

Nothing is imported here.
"""
