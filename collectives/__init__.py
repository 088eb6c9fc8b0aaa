"""Course companions and the local-rank launcher; the product (``custom_ddp``) uses none of them.

- ``sequential_print``: every rank prints in a fixed order using only barriers
  (``torchrun --nproc_per_node 3 -m collectives.sequential_print``).
- ``allreduce``: ring and butterfly all-reduce written with ``isend``/``irecv`` only.
- ``launcher``: ``run_workers``, a function run on local ranks joined in one process group (fork + gloo +
  ``file://``): how the tests, the conformance tables and the benchmarks bring up ranks in one process tree.

Pure torch; nothing is imported here.
"""
