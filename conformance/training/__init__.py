"""Training conformance: every gradient, buffer and parameter of a fit against its truth.

- ``base``: what every pattern is (a regression net, its data, how it is fit and compared).
- ``patterns``: the patterns users write every day; ``freeze_patterns`` (fine-tuning: layers unfrozen mid-fit),
  ``optimizer_patterns`` (around the optimizer step), ``resume_patterns`` (interrupted and resumed),
  ``uneven_patterns`` (uneven data per rank).
- ``runs``: one pattern fit under one process, ``ddp`` or ``custom_ddp``, and its comparison.
- ``table``: ``python -m conformance.training.table`` runs them all and writes the record and the manual's table.

Nothing is imported here.
"""
