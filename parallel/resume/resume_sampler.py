"""Resuming an epoch where it stopped: a sampler that leaves out what the interrupted run already trained.

A run resumed from a mid-epoch checkpoint restarts a plain ``DataLoader`` at the epoch's first
batch, while the training loop goes on counting from the batch it stopped at: the epoch's first
batches are trained twice and its last ones never. :class:`ResumeSampler` wraps the loader's
sampler (with a ``DistributedSampler`` the order is a function of its seed and epoch, the same in
the resumed run) and leaves the first ``skip`` indices out of its FIRST pass only; later passes
(the next epochs, or a shorter loader cycled within the epoch) are the sampler's own. ``skip`` may
be a callable, asked at the first pass: a training loop may set its loader up before it restores
the checkpoint that says how far the epoch got. With ``epoch`` it sets the resumed epoch at once: a
``DataLoader`` with workers draws indices when its iterator is made, which a training loop may do
before it calls ``set_epoch``. Pure torch; no Lightning.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import Sampler

__all__ = ["ResumeSampler"]


def _checked(skip: Any) -> int:
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip={skip!r} must be an int >= 0 (indices the interrupted epoch already trained)")
    return skip


class ResumeSampler(Sampler[int]):
    """``sampler``'s indices, the first ``skip`` of them left out of the first pass (module docstring).

    ``skip`` and ``epoch`` may be callables, asked when the first pass begins (and again after
    :meth:`rewind`). ``len()`` stays the sampler's: the epoch is as long as ever, this pass only
    begins later.
    """

    def __init__(
        self, sampler: Any, skip: int | Callable[[], int], epoch: int | Callable[[], int] | None = None
    ) -> None:
        if not callable(skip):
            _checked(skip)
        if not isinstance(sampler, Sized):
            raise ValueError(f"a {type(sampler).__name__} without len() cannot resume mid-epoch by index")
        self.sampler = sampler
        self._first_pass = (skip, epoch)
        self._pending: tuple[Any, Any] | None = self._first_pass  # None once the first pass began
        if isinstance(epoch, int):
            self.set_epoch(epoch)

    @property
    def first_pass_begun(self) -> bool:
        return self._pending is None

    def rewind(self) -> None:
        """The next pass is a first pass again (its iterator was made too early: made anew, it asks again)."""
        self._pending = self._first_pass

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        pending, self._pending = self._pending, None
        if pending is None:
            return iter(self.sampler)
        skip, epoch = pending
        if epoch is not None:
            self.set_epoch(epoch() if callable(epoch) else epoch)
        skip = _checked(skip() if callable(skip) else skip)
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)
