"""What an exact resume needs of the core.

- ``resume_sampler``: the rest of an interrupted epoch, in the sampler's own order.
- ``rng_state``: every rank's random generators, encoded as tensors (no ``torch.save`` off the writer).

May import: nothing else of ``parallel``. Nothing is imported here.
"""
