"""A resumed fit draws the random numbers the interrupted one would have drawn (``exact_resume``).

:mod:`exact_resume` makes a resumed fit train exactly the batches the interrupted one had
not; this module makes it draw the same random numbers for them (dropout masks, ``torch.randn``
noise, ``np.random`` and ``random`` calls, random transforms run in the main process), so a fit
resumed from a checkpoint ends bitwise as the uninterrupted one. ``ddp`` saves no generator: its
resumed fits draw from the restart's seed.

- **Saved** in every checkpoint written while fitting with every rank present (``ModelCheckpoint``,
  a signal's stop checkpoint, ``trainer.save_checkpoint``): every rank's generators
  (:mod:`parallel.resume.rng_state`: Python's, NumPy's global one, torch's CPU one and the rank's CUDA
  device's), gathered by
  one ``all_gather_object`` inside the save that every rank makes, under :data:`CHECKPOINT_KEY`.
  The watchdog's last checkpoint, written after a rank was lost, holds them as they were at the start
  of the accumulation window it goes back to, read from the job's store where every rank keeps them
  (:mod:`strategies.fault_tolerance.window_generators`; none when a rank's are missing there).
- **Restored** on every rank at ``on_train_start`` of a fit resumed on as many ranks: after
  everything Lightning restores, before the first batch. By then Lightning has made the resumed
  epoch's training iterator, which draws its workers' base seed (one int64, made by every
  ``DataLoader`` iterator, workers or not) from torch's generator. The interrupted fit drew that
  number before a mid-epoch checkpoint, so nothing more is needed there. A checkpoint from an epoch's
  end came before the next epoch's iterator, made after that epoch's ``on_train_epoch_start``: without
  workers, the draw is made again at the first fetch (:func:`redraw_base_seeds`, after the hook; for a
  loader ``exact_resume`` did not rebuild, at ``on_train_start``); with workers, a rebuilt loader's
  iterator is made anew after the restore (:mod:`exact_resume`), from the restored
  generators, so the workers' own draws repeat too (when the hook draws nothing).
- **Not restored**: draws in persistent workers (their streams run on across epochs; their one iterator
  draws no base seed after the first epoch, and a resume none either), draws in ``DataLoader`` workers
  resuming mid-epoch (the skipped batches' draws are not made) or from a checkpoint at an epoch's last
  batch's end (Lightning 2.6 counts the epoch done and skips the validation after it: one draw stands in
  for its iterator's, exact for one validation loader, one draw off when no validation was due), draws
  in ``on_train_epoch_start`` resuming from the watchdog's last checkpoint within an epoch's first
  window (kept before the hook, which Lightning does not call again mid-epoch), and generators a program
  owns. A checkpoint without states (another strategy's, a last checkpoint, ``exact_resume=False``) or
  from another number of ranks resumes with this run's generators and says so.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from parallel.resume.rng_state import RngState
from strategies.loaders import flat_loaders

__all__ = ["CHECKPOINT_KEY", "redraw_base_seeds", "rng_state_to_restore"]

CHECKPOINT_KEY = "custom_ddp_rng_states"  # a list: rank r's generators at index r


def rng_state_to_restore(checkpoint: dict[str, Any], rank: int, world_size: int) -> RngState | None:
    """This rank's generators from a resumed checkpoint, or ``None`` (logged) when it cannot have them."""
    states = checkpoint.get(CHECKPOINT_KEY)
    if states is None:
        rank_zero_info(
            "custom_ddp: the checkpoint holds no random generator states (written by another strategy, "
            "with exact_resume=False, or after a rank was lost whose states were not in the job's store): "
            "the resumed fit draws from this run's generators, not the interrupted fit's"
        )
        return None
    if len(states) != world_size:
        rank_zero_warn(
            f"custom_ddp: the checkpoint holds the random generators of {len(states)} ranks, this fit "
            f"runs on {world_size}: they are not restored, and the resumed fit's random draws differ "
            "from the interrupted fit's"
        )
        return None
    return states[rank]


def redraw_base_seeds(iterables: Any) -> None:
    """Draw from torch's generator what making an iterator of each ``DataLoader`` in ``iterables`` draws
    (the trainer's ``train_dataloader``: a loader, or a list or dict of them). A loader with a
    generator of its own draws from that one instead."""
    for loader in flat_loaders(iterables):
        if isinstance(loader, DataLoader) and loader.generator is None:
            torch.empty((), dtype=torch.int64).random_()  # as torch.utils.data's _BaseDataLoaderIter
