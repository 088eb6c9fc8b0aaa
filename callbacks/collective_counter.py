"""``CollectiveCounter``: a Lightning callback that records the collectives of every training
micro-batch window, attributed to their source by :mod:`measure.collective_count` (the rules and
the window boundaries are described there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.profiler import profile, record_function

from measure.collective_count import MARKER, Window, classify, profiler

__all__ = ["CollectiveCounter"]


class CollectiveCounter(Callback):
    """Record the collectives of every training micro-batch window, by source (module docstring).

    Args:
        out_dir: If given, each rank writes ``collectives_rank{R}.json`` (its windows) there at
            the end of training.
        max_batches: Stop profiling after this many micro-batch windows per fit (``None``: all).
    """

    def __init__(self, out_dir: str | Path | None = None, max_batches: int | None = None) -> None:
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches={max_batches} must be >= 1, or None to profile every batch")
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.max_batches = max_batches
        self.windows: list[Window] = []
        self._prof: profile | None = None

    def batch_counts(self) -> list[dict[str, int]]:
        """Counts by source of each micro-batch window, in order (the after-epoch windows left out)."""
        return [w.counts() for w in self.windows if w.batch_idx is not None]

    def _budget_left(self) -> bool:
        done = sum(1 for w in self.windows if w.batch_idx is not None)
        return self.max_batches is None or done < self.max_batches

    def _start(self) -> None:
        if self._budget_left():
            self._prof = profiler()
            self._prof.__enter__()

    def _stop(self, trainer: pl.Trainer, batch_idx: int | None, keep: bool = True) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        if keep:
            collectives = classify(prof, trainer.strategy.model)
            self.windows.append(Window(trainer.current_epoch, batch_idx, collectives))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.windows = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._prof is not None:
            with record_function(MARKER):
                pass

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop(trainer, batch_idx)
        self._start()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer, None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer, None, keep=False)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"collectives_rank{trainer.global_rank}.json"
            path.write_text(json.dumps([w.to_dict() for w in self.windows]))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop(trainer, None, keep=False)
