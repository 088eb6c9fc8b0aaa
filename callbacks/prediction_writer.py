"""``PredictionWriter``: saves what ``trainer.predict`` returns to a ``.pt`` file, merged or per rank.

Built on Lightning's ``BasePredictionWriter`` with ``write_interval="epoch"``: at the end of the
predict epoch every rank holds its batches of predictions and the dataset indices Lightning's
sampler gave them (Lightning records these for prediction writers). The batches are concatenated
into one dict of tensors with an added ``index`` (position in the predict dataset).

- ``merge=True`` (default): rank 0 gathers every rank's part with ``torch.distributed.gather_object``
  (no shared filesystem needed between nodes), sorts the rows by ``index`` and writes ONE file,
  so row ``i`` is dataset item ``i`` whatever the number of processes.
- ``merge=False``: each rank writes ``<stem>_rank<R>.pt`` with its own rows; nothing is communicated.

The file goes to ``output_path``, by default ``<trainer.log_dir>/predictions.pt`` (the run's
``lightning_logs/version_N/``); rank 0 logs where. Load it with ``torch.load(path)``. For
:class:`lit_cifar.module.LitClassifier` the keys are ``index``, ``pred``, ``top5``, ``probs`` and
``target``; a ``predict_step`` that returns a plain tensor is saved under ``prediction``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

__all__ = ["PredictionWriter"]

Part = dict[str, Tensor]


def _collate(batches: Sequence[Any], batch_indices: Sequence[Sequence[int]]) -> Part:
    """This rank's batches as one dict of tensors (batch dimension first) plus ``index``."""
    index = torch.tensor([i for batch in batch_indices for i in batch], dtype=torch.long)
    if not batches:
        return {"index": index}  # a rank can get no sample when the dataset is smaller than the world
    rows = [{"prediction": b} if isinstance(b, Tensor) else b for b in batches]
    if not all(isinstance(row, Mapping) and all(isinstance(v, Tensor) for v in row.values()) for row in rows):
        raise TypeError(
            f"PredictionWriter saves tensors or dicts of tensors; predict_step returned "
            f"{type(batches[0]).__name__}. Return e.g. {{'pred': tensor, ...}} per batch."
        )
    part = {key: torch.cat([row[key].detach().cpu() for row in rows]) for key in rows[0]}
    if any(len(value) != len(index) for value in part.values()):
        raise ValueError(
            f"PredictionWriter: predictions hold {[len(v) for v in part.values()]} rows for "
            f"{len(index)} samples; every predict_step output needs the batch dimension first."
        )
    return {**part, "index": index}


def _merge(parts: Sequence[Part]) -> Part:
    """All ranks' rows in dataset order."""
    keys = next((list(part) for part in parts if len(part["index"])), ["index"])
    merged = {key: torch.cat([part[key] for part in parts if key in part]) for key in keys}
    order = merged["index"].argsort()
    return {key: value[order] for key, value in merged.items()}


class PredictionWriter(BasePredictionWriter):
    """Write the predictions of ``trainer.predict`` to ``output_path``, merged over ranks or per rank.

    Args:
        output_path: Target file; default ``<trainer.log_dir>/predictions.pt``. With ``merge=False``
            each rank writes ``<stem>_rank<R><suffix>`` next to it.
        merge: Gather every rank's rows to rank 0 and write one file sorted by dataset index.
    """

    def __init__(self, output_path: str | None = None, merge: bool = True) -> None:
        super().__init__(write_interval="epoch")
        self.output_path = output_path
        self.merge = merge
        self.written: list[Path] = []  # the files this process wrote in the last predict run
        self._report: str | None = None

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.written = []
        if len(trainer.num_predict_batches) != 1:  # fail before predicting, not after
            raise ValueError(
                f"PredictionWriter writes one predict dataloader, got {len(trainer.num_predict_batches)}"
                "; return a single predict_dataloader or run predict once per dataloader."
            )

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        path = self._target(trainer)
        part = _collate(predictions, batch_indices[0] if batch_indices else [])
        if not self.merge:
            path = path.with_name(f"{path.stem}_rank{trainer.global_rank}{path.suffix}")
            self._save(part, path)
            self._report = (
                f"PredictionWriter: each rank wrote its predictions to {path.parent}/"
                f"{path.stem.rsplit('_rank', 1)[0]}_rank*{path.suffix}"
            )
            return
        parts = self._gather_to_rank_zero(part, trainer)
        if trainer.is_global_zero:
            merged = _merge(parts)
            self._save(merged, path)
            self._report = f"PredictionWriter: wrote predictions for {len(merged['index'])} samples to {path}"

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Said here, not when writing: by now the progress bar has closed its line.
        if self._report is not None:
            rank_zero_info(self._report)
            self._report = None

    def _target(self, trainer: Trainer) -> Path:
        if self.output_path is not None:
            return Path(self.output_path)
        # trainer.log_dir broadcasts rank 0's folder: every rank calls it, so it stays collective-safe.
        log_dir = trainer.log_dir
        return Path(log_dir if log_dir is not None else trainer.default_root_dir) / "predictions.pt"

    @staticmethod
    def _gather_to_rank_zero(part: Part, trainer: Trainer) -> list[Part] | None:
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return [part]
        # Lightning's strategies offer all_gather of equal-shaped tensors only; the parts differ in length.
        parts: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
        torch.distributed.gather_object(part, parts, dst=0)
        return parts

    def _save(self, part: Part, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(part, path)
        self.written.append(path)
