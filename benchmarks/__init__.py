"""Benchmarks: entry points that time and measure, each writing a record under ``benchmarks/results/<name>/``.

Here, the layer every benchmark shares:

- ``harness``: options, quiet-machine wait, interleaved rounds, estimates and the record's schema.
- ``report``: how a record reads (values with units, headline rows, ``results.md``, figures).
- ``readme_block`` and ``readme_results``: the generated results blocks of ``docs/benchmarks.md`` and README.md.
- ``rederive``: re-derive committed records from the raw samples they keep.
- ``one_gpu.sh``: the prepared one-GPU command.

One room per thing measured:

- ``batchnorm/``: the hand-written SyncBatchNorm's kernel and where its cost goes in a training step.
- ``collectives/``: hand-written all-reduce against gloo's, and the gradient synchronisation modes and ZeRO-1.
- ``fits/``: whole Lightning fits, ``custom_ddp`` against ``ddp``: step time, accuracy and collectives.
- ``costs/``: what one feature costs or saves per step (desync check, generator keeping, evaluation
  memory, the batched data pipeline).

A record's ``benchmark`` names its module under ``benchmarks`` (``batchnorm.syncbn``): ``rederive`` and the
results blocks load its ``headline`` and ``write`` from there. Nothing is imported here.
"""
