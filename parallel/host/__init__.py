"""The shared-memory transport of one host's CPU ranks: sums and exchanges in ``/dev/shm`` behind futex barriers.

- ``shm_barrier``: the futex barrier (a dead peer raises within ~0.1 s, a silent one after the timeout).
- ``host_reduce``: ``SharedMemoryAllReduce``, the gradient buckets summed in shared memory.
- ``host_exchange``: SyncBatchNorm's two collectives through the same memory.

May import: ``parallel.sync_config``. Nothing is imported here.
"""
