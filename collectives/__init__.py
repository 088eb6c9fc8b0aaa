"""Course companions; the product (``custom_ddp``) uses none of them.

- ``sequential_print``: every rank prints in a fixed order using only barriers
  (``torchrun --nproc_per_node 3 -m collectives.sequential_print``).
- ``allreduce``: ring and butterfly all-reduce written with ``isend``/``irecv`` only.

Pure torch; nothing is imported here.
"""
