"""Units of exact mid-epoch resume, without a fit: the sampler that leaves out what the interrupted epoch
trained (parallel.resume.resume_sampler) and the reading of Lightning's restored loop
(strategies.resume.resume_progress).
The fits that use them are in test_exact_resume.py."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.loops.progress import _BatchProgress
from torch.utils.data import DistributedSampler, SequentialSampler

from parallel.resume.resume_sampler import ResumeSampler
from strategies.resume.resume_progress import LoaderResume, batches_done


def test_resume_sampler_leaves_out_the_first_indices_of_its_first_pass_only() -> None:
    sampler = ResumeSampler(SequentialSampler(range(10)), skip=4)
    assert len(sampler) == 10 and not sampler.first_pass_begun
    assert list(sampler) == [4, 5, 6, 7, 8, 9]
    assert list(sampler) == list(range(10)) and sampler.first_pass_begun
    sampler.rewind()  # an iterator made too early: the next pass is a first pass again
    assert list(sampler) == [4, 5, 6, 7, 8, 9]


def test_resume_sampler_asks_for_skip_and_epoch_when_its_first_pass_begins() -> None:
    inner = DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=3)
    state = {"skip": 0, "epoch": 0}
    sampler = ResumeSampler(inner, lambda: state["skip"], lambda: state["epoch"])
    state.update(skip=2, epoch=5)  # the checkpoint is restored after the loader was set up
    inner.set_epoch(5)
    expected = list(inner)
    inner.set_epoch(0)
    assert list(sampler) == expected[2:]  # epoch 5's order, without a set_epoch call before the pass
    sampler.set_epoch(6)
    inner_epoch6 = list(inner)
    assert list(sampler) == inner_epoch6


@pytest.mark.parametrize("skip", [-1, 1.5, True])
def test_resume_sampler_rejects_a_bad_skip(skip: Any) -> None:
    with pytest.raises(ValueError, match="skip=.* must be an int >= 0"):
        ResumeSampler(SequentialSampler(range(3)), skip=skip)


def _progress(ready: int, processed: int, completed: int) -> Any:
    progress = _BatchProgress()
    for tracker in (progress.total, progress.current):
        tracker.ready = tracker.started = ready
        tracker.processed, tracker.completed = processed, completed
    return progress


def test_batches_done_counts_a_batch_saved_at_its_end_as_lightning_resumes_it() -> None:
    assert batches_done(_progress(ready=4, processed=4, completed=3)) == 4  # ModelCheckpoint / a signal's stop
    assert batches_done(_progress(ready=4, processed=3, completed=3)) == 3  # mid-batch: batch 3 is trained again
    assert batches_done(_progress(ready=4, processed=4, completed=4)) == 4  # after the batch (validation's end)


def test_a_loop_that_resumes_elsewhere_than_the_loader_raises_at_the_first_batch() -> None:
    resume = LoaderResume(None, length=6, batch_size=4, reason=None)  # type: ignore[arg-type]
    resume.done = 3
    with pytest.raises(RuntimeError, match="resumed epoch 1 at batch 3, but Lightning's loop resumed at batch 2"):
        resume.check(1, 2)
    resume.check(1, 3)
