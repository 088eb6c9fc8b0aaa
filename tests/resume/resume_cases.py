"""What the resume tests fit: a linear regression on indexed samples that records which samples each batch held,
checkpointed every 2 optimizer steps or at each epoch's end, on 2 ranks (or one process with the same options)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from conformance_harness import make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "ACCUMULATE",
    "BATCH",
    "EPOCHS",
    "FIT_OPTIONS",
    "SAMPLES",
    "Indexed",
    "Recorder",
    "assert_trained_the_rest_bitwise",
    "fit_recorded",
]

SAMPLES, BATCH, EPOCHS, ACCUMULATE = 48, 4, 2, 2  # 6 batches per rank and epoch, 3 optimizer steps
FIT_OPTIONS = {"max_epochs": EPOCHS, "accumulate_grad_batches": ACCUMULATE}  # every fit's, on 2 ranks or one


class Indexed(Dataset):
    """Fixed features and targets, with each sample's index (to record what was trained)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 5, generator=generator), torch.randn(SAMPLES, 2, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Recorder(pl.LightningModule):
    """A linear regression that records which samples each training batch held."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(5, 2)
        self.out = out
        self.seen: dict[tuple[int, int], list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen[(self.current_epoch, batch_idx)] = index.tolist()
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(), batch_size=BATCH, shuffle=True)

    def on_fit_end(self) -> None:
        state = {name: value.detach().clone() for name, value in self.state_dict().items()}
        torch.save({"state": state, "seen": self.seen}, self.out / f"rank{self.global_rank}.pt")


def fit_recorded(
    strategy: Any,
    out: Path,
    ckpt_path: Path | None = None,
    module: type[Recorder] | None = None,
    by_epoch: bool = False,
) -> list[dict[str, Any]]:
    """A fit that checkpoints every 2 optimizer steps (``step=S.ckpt``), or at each epoch's end (``epoch=E.ckpt``)."""
    out.mkdir(parents=True)
    pl.seed_everything(0, verbose=False)
    every = (
        {"filename": "{epoch}", "every_n_epochs": 1} if by_epoch else {"filename": "{step}", "every_n_train_steps": 2}
    )
    checkpoints = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, **every)
    trainer = make_trainer(strategy, enable_checkpointing=True, callbacks=[checkpoints], **FIT_OPTIONS)
    trainer.fit((module or Recorder)(out), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def assert_trained_the_rest_bitwise(
    resumed: list[dict[str, Any]], truth: list[dict[str, Any]], first: tuple[int, int]
) -> None:
    """Each rank trained the uninterrupted fit's batches from ``first`` (epoch, batch index) on, each once with
    the same samples, and ends with its weights, bitwise."""
    for rank in range(2):
        expected = {key: value for key, value in truth[rank]["seen"].items() if key >= first}
        assert resumed[rank]["seen"] == expected, f"rank {rank}"
        for name, value in truth[rank]["state"].items():
            assert torch.equal(resumed[rank]["state"][name], value), f"rank {rank}: {name}"
