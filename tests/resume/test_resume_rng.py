"""A resumed fit draws the interrupted fit's random numbers (strategies.resume.resume_rng, parallel.resume.rng_state).

The module draws from every default generator in its training step (dropout and ``torch.randn``,
``np.random``, ``random``), each rank from its own streams, and its dataset adds noise when a sample
is read (in the main process, or in workers: their draws repeat on resuming at an epoch's end, not
mid-epoch). The truth is the uninterrupted fit with the same strategy; a resume under Lightning's
``ddp`` (which saves no generator) shows that the check can fail.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conformance_harness import custom_strategy, ddp_strategy, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from parallel.resume.rng_state import rng_state, set_rng_state
from strategies.fault_tolerance.watchdog import Watchdog
from strategies.resume.resume_rng import CHECKPOINT_KEY, redraw_base_seeds, rng_state_to_restore

SAMPLES, BATCH, EPOCHS, ACCUMULATE = 48, 4, 2, 2  # 6 batches per rank and epoch, 3 optimizer steps


class Noisy(Dataset):
    """Fixed samples; with ``noise``, each read adds a fresh draw of torch's generator (a random transform)."""

    def __init__(self, noise: bool) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 5, generator=generator), torch.randn(SAMPLES, 2, generator=generator)
        self.noise = noise

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + (0.1 * torch.randn(5) if self.noise else 0.0), self.y[index]


class Stochastic(pl.LightningModule):
    """Dropout, input noise and NumPy/Python scale factors in every training step; validated every epoch
    (so the epoch-end checkpoint is written at the validation's end)."""

    def __init__(self, out: Path, workers: int, noise: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        self.out, self.workers, self.noise = out, workers, noise

    def setup(self, stage: str) -> None:
        pl.seed_everything(100 + self.global_rank, verbose=False)  # each rank its own streams: a mix-up shows

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scale = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
        return scale * nn.functional.mse_loss(self.net(x + 0.1 * torch.randn_like(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(self.noise), batch_size=BATCH, shuffle=True, num_workers=self.workers)

    def validation_step(self, batch: Any, batch_idx: int) -> None:  # its loader's iterator draws a base seed too
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(False), batch_size=BATCH)

    def on_fit_end(self) -> None:
        state = {name: value.detach().clone() for name, value in self.state_dict().items()}
        torch.save(state, self.out / f"rank{self.global_rank}.pt")


def _fit(
    strategy: Any,
    out: Path,
    workers: int,
    noise: bool,
    ckpt_path: Path | None = None,
    callbacks: tuple[pl.Callback, ...] = (),
    module: type[Stochastic] = Stochastic,
    **trainer_options: Any,
) -> list[dict]:
    out.mkdir(parents=True)
    checkpoints = [
        ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1),
        ModelCheckpoint(dirpath=out / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1),
        # At epoch 0's last batch: at the validation's end after it, and at its end (step 3)
        ModelCheckpoint(
            dirpath=out / "ckpt",
            filename="val_end_{epoch}",
            monitor="val_loss",
            save_top_k=-1,
            save_on_train_epoch_end=False,
        ),
        ModelCheckpoint(dirpath=out / "ckpt", filename="batch_end_{step}", every_n_train_steps=3, save_top_k=-1),
    ]
    trainer = make_trainer(
        strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        enable_checkpointing=True,
        callbacks=[*checkpoints, *callbacks],
        **trainer_options,
    )
    trainer.fit(module(out, workers, noise), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _same(resumed: list[dict], truth: list[dict]) -> bool:
    return all(torch.equal(resumed[rank][name], value) for rank in range(2) for name, value in truth[rank].items())


def _assert_resumes_bitwise(tmp_path: Path, workers: int, checkpoints: tuple[str, ...], **fit_options: Any) -> None:
    """An uninterrupted fit, then one resumed from each of its ``checkpoints``: each ends bitwise as it
    (noise in the main process when there are no workers)."""
    truth = _fit(custom_strategy(), tmp_path / "truth", workers, workers == 0, **fit_options)
    for checkpoint in checkpoints:
        resumed = _fit(
            custom_strategy(),
            tmp_path / checkpoint,
            workers,
            workers == 0,
            tmp_path / "truth" / "ckpt" / checkpoint,
            **fit_options,
        )
        assert _same(resumed, truth), checkpoint


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    runs: dict[tuple[int, bool], tuple[Path, list[dict]]] = {}

    def run(workers: int, noise: bool) -> tuple[Path, list[dict]]:
        if (workers, noise) not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted_w{workers}_{noise}") / "run"
            runs[(workers, noise)] = out, _fit(custom_strategy(), out, workers, noise)
        return runs[(workers, noise)]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize(
    "workers, noise, checkpoint",
    [
        (0, True, "step=2.ckpt"),  # mid-epoch 0: the sample noise drawn in the main process repeats too
        (0, True, "epoch=0.ckpt"),  # the next epoch's iterator drew its base seed after the checkpoint
        (0, True, "val_end_epoch=0.ckpt"),  # the loop finishes epoch 0 and makes epoch 1's iterator itself
        (0, True, "batch_end_step=3.ckpt"),  # the same, from epoch 0's last batch
        (1, False, "step=4.ckpt"),  # mid-epoch 1, a worker: its base seed drawn before the checkpoint
        (1, True, "epoch=0.ckpt"),  # the iterator made anew after the restore: the workers' draws repeat too
        (1, True, "val_end_epoch=0.ckpt"),
    ],
    ids=[
        "main_mid_epoch",
        "main_epoch_end",
        "main_val_end",
        "main_last_batch_end",
        "worker_mid_epoch",
        "worker_epoch_end",
        "worker_val_end",
    ],
)
def test_a_resumed_fit_draws_the_interrupted_fits_random_numbers_and_ends_bitwise(
    tmp_path: Path, uninterrupted: Any, workers: int, noise: bool, checkpoint: str
) -> None:
    out, truth = uninterrupted(workers, noise)
    resumed = _fit(custom_strategy(), tmp_path / "resumed", workers, noise, out / "ckpt" / checkpoint)
    assert _same(resumed, truth)


@pytest.mark.distributed
def test_ddp_resumes_with_the_restarts_generators(tmp_path: Path, uninterrupted: Any) -> None:
    """What the test above would catch: the same checkpoint's batches, other random draws."""
    out, truth = uninterrupted(0, True)
    assert not _same(_fit(ddp_strategy(), tmp_path / "ddp", 0, True, out / "ckpt" / "epoch=0.ckpt"), truth)


class EpochScale(Stochastic):
    """A random loss scale drawn in ``on_train_epoch_start``, each rank its own."""

    epoch_scale = 1.0

    def on_train_epoch_start(self) -> None:
        self.epoch_scale = 1.0 + float(torch.rand(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.epoch_scale * super().training_step(batch, batch_idx)


@pytest.mark.distributed
def test_draws_in_on_train_epoch_start_repeat_after_a_resume(tmp_path: Path) -> None:
    """From an epoch's end, the resumed fit calls the next epoch's ``on_train_epoch_start`` before it makes
    that epoch's iterator, as the uninterrupted fit did: the base seed is drawn at the first fetch, not at
    ``on_train_start``. (Resuming mid-epoch, Lightning does not call the hook again: what a module sets
    there is its own state to keep.)"""
    _assert_resumes_bitwise(tmp_path, 0, ("epoch=0.ckpt", "val_end_epoch=0.ckpt"), module=EpochScale)


class PersistentWorkers(Stochastic):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(False), batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True)


@pytest.mark.distributed
def test_persistent_workers_resume_bitwise_from_an_epochs_end(tmp_path: Path) -> None:
    """Persistent workers keep one iterator for the whole fit: later epochs draw no base seed, and neither
    may the resume (on ee06279 it drew one, shifting every later draw)."""
    _assert_resumes_bitwise(
        tmp_path, 1, ("epoch=0.ckpt", "val_end_epoch=0.ckpt", "step=4.ckpt"), module=PersistentWorkers
    )


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 1])
def test_loaders_reloaded_every_epoch_resume_bitwise(tmp_path: Path, workers: int) -> None:
    """``reload_dataloaders_every_n_epochs=1``: the loader set up before the restore is replaced before the
    first batch (on ee06279 its never-iterated first pass failed the first-batch check from an epoch's end)."""
    _assert_resumes_bitwise(
        tmp_path, workers, ("epoch=0.ckpt", "step=2.ckpt", "step=4.ckpt"), reload_dataloaders_every_n_epochs=1
    )


class TwoLoaders(Stochastic):
    """A dict of two training loaders; Lightning cycles the shorter (3 batches) within the 6-batch epoch."""

    def train_dataloader(self) -> dict[str, DataLoader]:
        return {
            "a": DataLoader(Noisy(self.noise), batch_size=BATCH, shuffle=True, num_workers=self.workers),
            "b": DataLoader(Noisy(self.noise), batch_size=2 * BATCH, shuffle=True, num_workers=self.workers),
        }

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch["a"], batch_idx) + super().training_step(batch["b"], batch_idx)


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 1])
def test_two_loaders_resume_bitwise_past_the_shorter_ones_length(tmp_path: Path, workers: int) -> None:
    """Resumed at batch 4, the 3-batch loader is 1 batch into its second pass (on the previous tree it
    counted the epoch from its own length, skipped nothing, and failed the first-batch check)."""
    _assert_resumes_bitwise(
        tmp_path, workers, ("step=2.ckpt", "epoch=0.ckpt", "val_end_epoch=0.ckpt"), module=TwoLoaders
    )


class _FirstBatchGenerator(pl.Callback):
    """Each rank's torch generator as its first training batch starts, saved in ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        path = self.out / f"first_batch_rank{trainer.global_rank}.pt"
        if not path.exists():
            torch.save(torch.get_rng_state(), path)


@pytest.mark.distributed
@pytest.mark.parametrize("checkpoint", [None, "step=2.ckpt", "epoch=0.ckpt"], ids=["fresh", "mid_epoch", "epoch_end"])
def test_the_generators_kept_at_training_start_are_those_a_checkpoint_there_must_hold(
    tmp_path: Path, uninterrupted: Any, monkeypatch: pytest.MonkeyPatch, checkpoint: str | None
) -> None:
    """What the watchdog's last checkpoint holds when a rank is lost in a fit's first window
    (strategies.fault_tolerance.window_generators): resumed, the checkpoint's own generators (at an epoch's start those
    before its iterator drew, which a resume draws again); fresh, those before the first training
    iterator drew its base seed."""
    kept = tmp_path / "kept"
    kept.mkdir()
    keep = Watchdog.training_starts

    def recorded(self: Watchdog, trainer: pl.Trainer, generators: Any) -> None:
        torch.save(generators, kept / f"rank{trainer.global_rank}.pt")
        keep(self, trainer, generators)

    monkeypatch.setattr(Watchdog, "training_starts", recorded)  # forked ranks inherit it
    out, _ = uninterrupted(0, False)
    ckpt_path = out / "ckpt" / checkpoint if checkpoint else None
    _fit(custom_strategy(), tmp_path / "run", 0, False, ckpt_path, callbacks=(_FirstBatchGenerator(kept),))
    for rank in range(2):
        state = torch.load(kept / f"rank{rank}.pt", weights_only=True)
        if ckpt_path is not None:
            saved = torch.load(ckpt_path, weights_only=True)[CHECKPOINT_KEY][rank]
            assert torch.equal(state["torch"], saved["torch"]) and state["python"] == saved["python"]
            assert torch.equal(state["numpy"][1], saved["numpy"][1]) and state["numpy"][2:] == saved["numpy"][2:]
        else:
            set_rng_state(state)
            torch.empty((), dtype=torch.int64).random_()  # the first training iterator's base seed
            assert torch.equal(torch.get_rng_state(), torch.load(kept / f"first_batch_rank{rank}.pt"))


def test_rng_state_round_trips_every_default_generator_and_loads_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.randn()  # a cached Gaussian is part of NumPy's state
    state = rng_state()
    expected = (torch.rand(3), np.random.rand(3), np.random.randn(), random.random())
    torch.save({CHECKPOINT_KEY: [state]}, tmp_path / "ckpt")
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(torch.load(tmp_path / "ckpt", weights_only=True)[CHECKPOINT_KEY][0])
    again = (torch.rand(3), np.random.rand(3), np.random.randn(), random.random())
    assert torch.equal(again[0], expected[0]) and np.array_equal(again[1], expected[1]) and again[2:] == expected[2:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rng_state_round_trips_the_current_cuda_devices_generator() -> None:
    torch.cuda.manual_seed(1)
    torch.rand(1, device="cuda")  # CUDA in use: its generator is part of the state
    state = rng_state()
    expected = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(9)
    set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def test_a_checkpoint_without_states_or_from_other_ranks_is_not_restored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        assert rng_state_to_restore({}, rank=0, world_size=2) is None
    assert "holds no random generator states" in caplog.text
    with pytest.warns(UserWarning, match="random generators of 3 ranks, this fit runs on 2"):
        assert rng_state_to_restore({CHECKPOINT_KEY: [{}, {}, {}]}, rank=0, world_size=2) is None
    assert rng_state_to_restore({CHECKPOINT_KEY: ["r0", "r1"]}, rank=1, world_size=2) == "r1"


def test_redraw_base_seeds_draws_what_making_each_loaders_iterator_draws() -> None:
    torch.manual_seed(5)
    iter(DataLoader(range(4))), iter(DataLoader(range(4)))
    expected = torch.rand(2)
    torch.manual_seed(5)
    own = torch.Generator().manual_seed(0)  # a loader with its own generator draws from that one
    redraw_base_seeds({"a": DataLoader(range(4)), "b": [DataLoader(range(2)), DataLoader(range(2), generator=own)]})
    assert torch.equal(torch.rand(2), expected)
