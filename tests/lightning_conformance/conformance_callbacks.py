"""Callbacks that record what each rank evaluated, predicted and reached, for ``test_conformance_*.py``
(the fork launcher hands none of it back to the parent): one file per rank, read back by the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback


class RecordEvalOutputs(Callback):
    """Per rank: every evaluated batch and the step's output, saved at the epoch end (not sanity)."""

    def __init__(self, out_dir: Path, key: str) -> None:
        self.out_dir, self.key = out_dir, key
        self.rows: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def _record(self, outputs: Any, batch: Any) -> None:
        self.rows.append(batch.detach().clone())
        self.outputs.append(outputs[self.key].detach().clone().reshape(1))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._record(outputs, batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._record(outputs, batch)

    def _save(self, trainer, stage: str) -> None:
        if trainer.sanity_checking:
            return
        torch.save({"rows": self.rows, "outputs": self.outputs}, self.out_dir / f"{stage}_rank{trainer.global_rank}.pt")
        self.rows, self.outputs = [], []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._save(trainer, "validate")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._save(trainer, "test")


class RecordProgress(Callback):
    """Per rank, at the end of fitting: the trainer's global step and epoch (the fork launcher
    does not hand these back to the parent's trainer)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        record = {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch}
        (self.out_dir / f"progress_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def read_progress(out_dir: Path, world_size: int = 2) -> list[dict]:
    return [json.loads((out_dir / f"progress_rank{rank}.json").read_text()) for rank in range(world_size)]


class SavePredictions(BasePredictionWriter):
    """Lightning's documented way to collect predictions from every rank: one file per rank."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__(write_interval="epoch")
        self.out_dir = out_dir

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        torch.save(
            {"predictions": predictions, "batch_indices": batch_indices},
            self.out_dir / f"predictions_rank{trainer.global_rank}.pt",
        )
