"""Uneven data per rank: loaders that join, so every rank runs the same steps.

- ``joined_loader``: one rank's loader yielding empty batches once its data ends, until every rank's has;
  which ranks trained each step (``StepShare``); the refusing variant's error.

May import: nothing else of ``parallel``. Nothing is imported here.
"""
