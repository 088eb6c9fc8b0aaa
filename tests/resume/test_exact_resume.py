"""Exact mid-epoch resume (strategies.resume.exact_resume): the resumed epoch trains exactly the batches the
interrupted one had not, so a resumed fit ends with an uninterrupted fit's weights, bitwise.

The truth is the uninterrupted fit with the same strategy; Lightning's ``ddp`` (which starts the
epoch over) is run too, to show that the check can fail.
"""

from __future__ import annotations

import itertools
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from conformance_harness import custom_strategy, ddp_strategy, make_trainer
from resume_cases import (
    BATCH,
    FIT_OPTIONS,
    SAMPLES,
    Indexed,
    Recorder,
    assert_trained_the_rest_bitwise,
    fit_recorded,
)
from torch.utils.data import DataLoader, DistributedSampler

from strategies.custom_ddp import CustomDDPStrategy
from strategies.resume.epoch_order import changed_order_warning, epoch_order, order_changes


def _assert_resumed_from_epoch_0s_end_trains_epoch_1s_order(tmp_path: Path, module: type[Recorder]) -> None:
    """A fit checkpointing at each epoch's end; one resumed from epoch 0's end trains the rest bitwise, and
    ``ddp`` resumed from it trains epoch 0's order again (what the first check would catch)."""
    truth = fit_recorded(custom_strategy(), tmp_path / "full", module=module, by_epoch=True)
    checkpoint = tmp_path / "full" / "ckpt" / "epoch=0.ckpt"
    resumed = fit_recorded(custom_strategy(), tmp_path / "resumed", checkpoint, module, by_epoch=True)
    ddp = fit_recorded(ddp_strategy(), tmp_path / "ddp", checkpoint, module, by_epoch=True)
    assert_trained_the_rest_bitwise(resumed, truth, (1, 0))
    assert ddp[0]["seen"][(1, 0)] == truth[0]["seen"][(0, 0)]  # epoch 0's first batch, again


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    return out, fit_recorded(custom_strategy(), out)


@pytest.mark.distributed
@pytest.mark.parametrize("step", [2, 4], ids=["epoch0_batch4", "epoch1_batch2"])
def test_a_fit_resumed_mid_epoch_trains_the_rest_of_the_epoch_and_ends_bitwise_as_uninterrupted(
    tmp_path: Path, uninterrupted: tuple[Path, list[dict[str, Any]]], step: int
) -> None:
    out, truth = uninterrupted
    resumed = fit_recorded(custom_strategy(), tmp_path / "resumed", out / "ckpt" / f"step={step}.ckpt")
    assert_trained_the_rest_bitwise(resumed, truth, {2: (0, 4), 4: (1, 2)}[step])  # after the checkpoint


class OneCycle(Recorder):
    """Lightning's documented OneCycle pattern: ``estimated_stepping_batches`` in ``configure_optimizers``
    makes Lightning set the training loader up, and make its iterator, before it restores the checkpoint."""

    workers = 0

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=self.workers)


class Workers(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=1)


class OneCycleWorkers(OneCycle):
    workers = 1


@pytest.mark.distributed
@pytest.mark.parametrize("module", [OneCycle, Workers, OneCycleWorkers])
def test_loaders_set_up_before_the_restore_or_iterated_by_workers_resume_bitwise(
    tmp_path: Path, module: type[Recorder]
) -> None:
    """With workers, the loop's iterator draws indices when it is made: before the restore (OneCycle)
    or before ``set_epoch`` (every resumed fit). The resumed epoch's samples, in its order, each once."""
    truth = fit_recorded(custom_strategy(), tmp_path / "full", module=module)
    resumed = fit_recorded(
        custom_strategy(), tmp_path / "resumed", tmp_path / "full" / "ckpt" / "step=4.ckpt", module=module
    )
    assert_trained_the_rest_bitwise(resumed, truth, (1, 2))


@pytest.mark.distributed
def test_a_fit_resumed_from_an_epochs_end_with_workers_trains_the_next_epochs_order(tmp_path: Path) -> None:
    """Lightning makes the resumed fit's iterator before it counts the finished epoch done; workers draw its
    indices at once, in the finished epoch's order (``ddp`` trains that order again, checked too)."""
    _assert_resumed_from_epoch_0s_end_trains_epoch_1s_order(tmp_path, Workers)


@pytest.mark.distributed
def test_ddp_starts_the_epoch_over_on_the_same_resume(
    tmp_path: Path, uninterrupted: tuple[Path, list[dict[str, Any]]]
) -> None:
    """Lightning's ddp trains the epoch's first batches again: what the test above would catch."""
    out, truth = uninterrupted
    resumed = fit_recorded(ddp_strategy(), tmp_path / "ddp", out / "ckpt" / "step=4.ckpt")
    assert resumed[0]["seen"][(1, 2)] == truth[0]["seen"][(1, 0)]  # batch index 2 got the epoch's first batch
    assert not torch.equal(resumed[0]["state"]["net.weight"], truth[0]["state"]["net.weight"])


class ReversedOrder(torch.utils.data.Sampler):
    """A sampler of the user's own (Lightning wraps it in a DistributedSamplerWrapper)."""

    def __iter__(self):
        return iter(range(SAMPLES - 1, -1, -1))

    def __len__(self) -> int:
        return SAMPLES


class OwnSampler(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=BATCH, sampler=ReversedOrder())


def _fit_here(module: Recorder, ckpt_path: Path | None = None) -> dict[str, Any]:
    """One process with the popen launcher: the fit runs in this process, where pytest sees its warnings."""
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(CustomDDPStrategy(timeout=timedelta(seconds=60)), devices=1, **FIT_OPTIONS)
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    finally:  # the group lives in this process: forked ranks of later tests must not inherit it
        if dist.is_initialized():
            dist.destroy_process_group()
    return torch.load(module.out / "rank0.pt", weights_only=False)


def test_a_loader_with_a_sampler_of_its_own_starts_the_epoch_over_with_a_warning(
    tmp_path: Path, uninterrupted: tuple[Path, list[dict[str, Any]]]
) -> None:
    out, _ = uninterrupted
    (tmp_path / "fresh").mkdir()
    fresh = _fit_here(OwnSampler(tmp_path / "fresh"))
    with pytest.warns(
        UserWarning,
        match="resuming epoch 1 at batch 2, but the training loader is sampled by a "
        "DistributedSamplerWrapper, which cannot resume by index",
    ):
        resumed = _fit_here(OwnSampler(tmp_path), out / "ckpt" / "step=4.ckpt")
    assert resumed["seen"][(1, 2)] == fresh["seen"][(1, 0)]  # batch index 2 got the epoch's first batch, as under ddp


def _resume_here_warning(tmp_path: Path, checkpoint: Path, module: type[Recorder] = Recorder) -> tuple[str, Any]:
    """Resume ``checkpoint`` in one process; custom_ddp's warning that the resume is not exact, and the run."""
    with pytest.warns(UserWarning) as said:
        resumed = _fit_here(module(tmp_path), checkpoint)
    return next(str(w.message) for w in said if "does not order the epoch as" in str(w.message)), resumed


def test_a_mid_epoch_resume_on_another_number_of_ranks_warns_what_it_trains_again(
    tmp_path: Path, uninterrupted: tuple[Path, list[dict[str, Any]]]
) -> None:
    """2 ranks stopped at batch 4 of 6 (32 of the epoch's 48 samples trained); one process resumes there and,
    its loop counting per rank, trains its shard's batches 4-11: 16 of those 32 again, each other sample once."""
    out, truth = uninterrupted
    warning, resumed = _resume_here_warning(tmp_path, out / "ckpt" / "step=2.ckpt")
    assert (
        "resuming epoch 0 at batch 4, but the training loader does not order the epoch as the interrupted " in warning
    )
    assert "(ranks 2 -> 1): each rank leaves out its first 4 batches" in warning
    assert "16 samples of this run's shards, not the 32 the interrupted epoch trained: 16 samples the " in warning
    trained = {
        i
        for rank in truth
        for (epoch, batch), indices in rank["seen"].items()
        if (epoch, batch) < (0, 4)
        for i in indices
    }
    again = [i for (epoch, _), indices in resumed["seen"].items() if epoch == 0 for i in indices]
    assert (len(trained), len(again), len(set(again) & trained)) == (32, 32, 16)
    assert trained | set(again) == set(range(SAMPLES))  # nothing of the epoch left out


class LargerBatches(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=2 * BATCH, shuffle=True)


def test_a_mid_epoch_resume_with_other_batches_warns_naming_every_change(
    tmp_path: Path, uninterrupted: tuple[Path, list[dict[str, Any]]]
) -> None:
    out, _ = uninterrupted
    warning, _ = _resume_here_warning(tmp_path, out / "ckpt" / "step=2.ckpt", LargerBatches)
    assert "(ranks 2 -> 1, batch_size 4 -> 8): each rank leaves out its first 4 batches" in warning
    assert "which hold other samples than the ones the interrupted epoch trained" in warning


def test_the_epoch_order_names_what_decides_it_and_the_warning_counts_samples_left_out() -> None:
    loader = DataLoader(Indexed(), batch_size=BATCH, sampler=DistributedSampler(Indexed(), 2, 0, seed=3))
    order = epoch_order(loader, ranks=2)
    assert order == {
        "ranks": 2,
        "samples": SAMPLES,
        "batch_size": BATCH,
        "drop_last": False,
        "sampler": "DistributedSampler",
        "seed": 3,
        "shuffle": True,
    }
    assert order_changes(order, {**order, "seed": 4}) == {"seed": (3, 4)}
    assert epoch_order(OwnSampler(Path()).train_dataloader(), 2) is not None  # rebuilt or not, its order is known
    # 1 rank stopped at batch 4 of batches of 4 (16 samples); 2 ranks skip 4 batches each: 32, 16 never trained.
    warning = changed_order_warning(0, 4, BATCH, {"ranks": (1, 2)}, shards=SAMPLES)
    assert (
        "32 samples of this run's shards, not the 16 the interrupted epoch trained: 16 samples it had not " in warning
    )


class PositionLoader(DataLoader):
    """A loader resumable the way Lightning's docs ask (``state_dict``/``load_state_dict``, as torchdata's
    ``StatefulDataLoader``): it keeps its position in the epoch and, after ``load_state_dict``, goes on there.
    Like torchdata's, it makes its iterator when iterated (with workers, they draw indices at once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = self._resume_at = 0

    def __iter__(self) -> Any:
        self._position, self._resume_at = self._resume_at, 0
        return self._from_position(super().__iter__())

    def _from_position(self, batches: Any) -> Any:
        for batch in itertools.islice(batches, self._position, None):
            self._position += 1
            yield batch
        self._position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = state["position"]


class Resumable(Recorder):
    workers = 0

    def train_dataloader(self) -> DataLoader:
        return PositionLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=self.workers)


class ResumableWorkers(Resumable):
    workers = 1


@pytest.mark.distributed
def test_a_loader_that_keeps_its_position_is_left_to_lightning_and_resumes_bitwise(tmp_path: Path) -> None:
    """Lightning loads a resumable loader's position from the checkpoint: it is neither rebuilt nor warned
    about (it does not start the epoch over). Lightning makes its iterator before it sets the sampler's epoch,
    and a worker draws the indices at once: the restored epoch is set first (``ddp`` trains epoch 0's order)."""
    truth = fit_recorded(custom_strategy(), tmp_path / "full", module=ResumableWorkers)
    checkpoint = tmp_path / "full" / "ckpt" / "step=4.ckpt"
    resumed = fit_recorded(custom_strategy(), tmp_path / "resumed", checkpoint, ResumableWorkers)
    ddp = fit_recorded(ddp_strategy(), tmp_path / "ddp", checkpoint, ResumableWorkers)
    assert_trained_the_rest_bitwise(resumed, truth, (1, 2))
    assert ddp[0]["seen"][(1, 2)] != truth[0]["seen"][(1, 2)]  # what the check above would catch
    (tmp_path / "here").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        here = _fit_here(Resumable(tmp_path / "here"), checkpoint)  # 12 batches per epoch in one process
    assert not [warning for warning in caught if "starts the epoch over" in str(warning.message)]
    assert sorted(here["seen"]) == [(1, batch) for batch in range(2, 12)]  # on from rank 0's position


@pytest.mark.distributed
def test_a_loader_that_keeps_its_position_resumed_from_an_epochs_end_trains_the_next_epochs_order(
    tmp_path: Path,
) -> None:
    """From an epoch's end the epoch Lightning sets next is one past the restored one (``ddp``'s worker draws
    the finished epoch's order again)."""
    _assert_resumed_from_epoch_0s_end_trains_epoch_1s_order(tmp_path, ResumableWorkers)
