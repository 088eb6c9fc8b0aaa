"""Course companions and the local multi-process launcher; the product (``custom_ddp``) uses none of them.

- ``sequential_print``: every rank prints in a fixed order using only barriers
  (``torchrun --nproc_per_node 3 -m collectives.sequential_print``).
- ``allreduce``: ring and butterfly all-reduce written with ``isend``/``irecv`` only.
- ``launcher``: ``run_workers(fn, world_size)``, the fork + gloo + ``file://`` launcher that the
  tests and benchmarks use to run a function on several local ranks.

Pure torch; nothing is imported here.
"""
