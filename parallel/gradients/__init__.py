"""The gradient sync: flat buckets all-reduced during backward, accumulation-aware, and ZeRO-1.

- ``buckets``: parameters packed into flat buckets (views, dtypes, caps).
- ``reducer``: the bucket launches and waits, hooked into autograd; ``sparse_grads``: sparse gradients apart.
- ``buffer_sync``: buffers (BatchNorm running stats) from rank 0, as torch DDP broadcasts them.
- ``grad_sync``: ``SyncedDataParallel`` (``no_sync()`` for accumulation; per-parameter / flat / bucketed modes).
- ``zero``: ``ShardedOptimizer`` (ZeRO-1).

May import: ``parallel.host`` (the shared-memory transport), ``parallel.batchnorm`` (which buffers are
statistics), ``parallel.sync_config``, ``parallel.dist_utils``. Nothing is imported here.
"""
