"""Exact resume: a fit resumed from a mid-epoch checkpoint trains what the interrupted one had not, with its draws.

- ``exact_resume``: :class:`ExactResume`, the component the strategy hooks in (loaders rebuilt to skip the
  batches done, every rank's random generators saved into and restored from checkpoints).
- ``resume_progress``: where a resumed fit goes on, read from Lightning's restored loop.
- ``epoch_order``: what orders a training epoch, saved in checkpoints; a resume that orders it otherwise warns.
- ``resume_rng``: which generators a resumed fit restores (:data:`CHECKPOINT_KEY` in the checkpoint).

May import: :mod:`parallel`, Lightning and :mod:`strategies.loaders`. Nothing outside this package imports its
modules: use the names below.
"""

from strategies.resume.exact_resume import ExactResume
from strategies.resume.resume_rng import CHECKPOINT_KEY

__all__ = ["CHECKPOINT_KEY", "ExactResume"]
