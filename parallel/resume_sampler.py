"""Resuming an epoch where it stopped: a sampler that leaves out what the interrupted run already trained.

A run resumed from a mid-epoch checkpoint restarts a plain ``DataLoader`` at the epoch's first
batch, while the training loop goes on counting from the batch it stopped at: the epoch's first
batches are trained twice and its last ones never. :class:`ResumeSampler` wraps the loader's
sampler (with a ``DistributedSampler`` the order is a function of its seed and epoch, the same in
the resumed run) and leaves the first ``skip`` indices out of its FIRST pass only; later passes
(the next epochs, or a shorter loader cycled within the epoch) are the sampler's own. It sets the
resumed epoch at once: a ``DataLoader`` with workers draws indices when its iterator is made, which
a training loop may do before it calls ``set_epoch``. Pure torch; no Lightning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any, Optional

from torch.utils.data import Sampler

__all__ = ["ResumeSampler"]


class ResumeSampler(Sampler[int]):
    """``sampler``'s indices, the first ``skip`` of them left out of the first pass (module docstring).

    ``len()`` stays the sampler's: the epoch is as long as ever, this pass only begins later.
    """

    def __init__(self, sampler: Any, skip: int, epoch: Optional[int] = None) -> None:
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip={skip!r} must be an int >= 0 (indices the interrupted epoch already trained)")
        if not isinstance(sampler, Sized):
            raise ValueError(f"a {type(sampler).__name__} without len() cannot resume mid-epoch by index")
        self.sampler = sampler
        self._skip = skip
        if epoch is not None:
            self.set_epoch(epoch)

    @property
    def pending_skip(self) -> int:
        """Indices the next pass leaves out (0 once the first pass began)."""
        return self._skip

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)
