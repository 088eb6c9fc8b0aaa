"""A small real ``custom_ddp`` fit on 2 CPU processes that the fault matrix injects faults into.

Started as ``python -m conformance.faults.fit --out DIR ...`` (rank 0; Lightning's popen launcher
re-runs the command for rank 1). Every rank appends JSON lines to ``DIR/events_rank<r>.jsonl``:
``start`` (pid), ``train_batch`` / ``val_batch`` (epoch, batch, global step), ``ckpt_save``,
``fault`` (an injected exception or rank-only collective, just before it happens) and ``exit``
(the exit code, or the error type). :mod:`conformance.faults.matrix` reads them to time the faults
it sends from outside (signals) and to find the ranks' process ids.

Faults the script injects itself (``RANK:EPOCH:BATCH``): ``--raise_at`` raises on that rank only
(``--raise_after_forward_at``: after its forward, while its peer goes on into backward);
``--rank_collective_at`` logs with ``sync_dist=True`` on that rank only (one all_reduce the other
rank never issues). ``--hold RANK:EPOCH:BATCH:SECONDS`` makes one rank sleep at the start of a
training batch, so its peer waits inside the batch's first collective (a SyncBN all_gather) while
a signal arrives; ``--ckpt_hold SECONDS`` sleeps inside the first checkpoint save on every rank
(``--ckpt_hold_rank R``: on that rank only). Stalls: ``--loop_at`` loops forever in
``training_step`` on that rank; ``--block_loader_at`` makes that rank's training DataLoader block
from that batch on. Faults fire in the first attempt of a ``torchrun --max-restarts`` job only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from strategies.custom_ddp import CustomDDPStrategy

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # torchrun restarts run clean


class BlockingDataset(TensorDataset):
    """A TensorDataset whose ``__getitem__`` blocks for good once ``block`` is set (a hung filesystem)."""

    block = False

    def __getitem__(self, index: int) -> Any:
        while self.block:
            time.sleep(1.0)
        return super().__getitem__(index)


SAMPLES, VAL_SAMPLES, BATCH = 384, 128, 16  # 12 training batches per rank and epoch, 4 validation batches


def _where(spec: str | None, fields: int = 3) -> tuple[float, ...] | None:
    if not spec:
        return None
    parts = tuple(float(p) for p in spec.split(":"))
    if len(parts) != fields:
        raise SystemExit(f"expected {fields} ':'-separated numbers, got {spec!r}")
    return parts


class Events:
    """Append-only JSON lines for one rank (each line flushed: a killed process keeps what it wrote)."""

    def __init__(self, out: Path, rank: int) -> None:
        self._path = out / f"events_rank{rank}.jsonl"
        self.rank = rank

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"event": event, "rank": self.rank, "pid": os.getpid(), "t": time.time(), **fields}
        with open(self._path, "a") as stream:
            stream.write(json.dumps(record) + "\n")


class FaultNet(pl.LightningModule):
    """Conv + BatchNorm (two SyncBN collectives per step) + dropout + linear, with the faults of ``args``.
    Each rank draws its dropout masks from its own stream: a resume is bitwise only with every rank's
    generators as the interrupted fit left them."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(128, 10),
        )
        self.events: Events | None = None
        self._saves = 0

    def _at(self, spec: tuple[float, ...] | None, batch_idx: int) -> bool:
        return (
            FIRST_ATTEMPT
            and spec is not None
            and int(spec[0]) == self.global_rank
            and int(spec[1]) == self.current_epoch
            and int(spec[2]) == batch_idx
        )

    def setup(self, stage: str) -> None:
        pl.seed_everything(100 + self.global_rank, verbose=False)  # after the weights: those are the same everywhere

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.events is not None
        self.events("train_batch", epoch=self.current_epoch, batch=batch_idx, step=self.global_step)
        hold = _where(self.args.hold, 4)
        if self._at(hold, batch_idx):
            time.sleep(hold[3])
        if self._at(_where(self.args.loop_at), batch_idx):
            self.events("fault", kind="loop")
            while True:  # an endless loop in user code: the main thread never comes back
                pass
        if self._at(_where(self.args.raise_at), batch_idx):
            self.events("fault", kind="exception")
            raise RuntimeError(f"injected fault: rank {self.global_rank} raised in training_step")
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self._at(_where(self.args.raise_after_forward_at), batch_idx):  # the peer's BatchNorm has moved
            self.events("fault", kind="exception")
            raise RuntimeError(f"injected fault: rank {self.global_rank} raised in training_step after its forward")
        if self._at(_where(self.args.rank_collective_at), batch_idx):
            self.events("fault", kind="rank_collective")
            self.log("rank_only", loss.detach(), on_step=True, sync_dist=True)  # an all_reduce on this rank only
        time.sleep(self.args.step_sleep)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._at(_where(self.args.block_loader_at), batch_idx + 1):
            self.events("fault", kind="block_loader")
            BlockingDataset.block = True  # the next fetch (num_workers=0: in this thread) blocks

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        assert self.events is not None
        if not self.trainer.sanity_checking:
            self.events("val_batch", epoch=self.current_epoch, batch=batch_idx, step=self.global_step)
        time.sleep(self.args.val_sleep)
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        assert self.events is not None
        self.events("ckpt_save", epoch=self.current_epoch, step=self.global_step)
        self._saves += 1
        if self._saves == 1 and self.args.ckpt_hold_rank in (None, self.global_rank):
            if self.args.ckpt_hold_rank is not None:
                self.events("fault", kind="slow_save", seconds=self.args.ckpt_hold)
            time.sleep(self.args.ckpt_hold)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def _loader(self, samples: int, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(samples, 3, 8, 8, generator=generator)
        y = torch.randint(0, 10, (samples,), generator=generator)
        return DataLoader(BlockingDataset(x, y), batch_size=BATCH, shuffle=seed == 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(SAMPLES, 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(VAL_SAMPLES, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout, seconds")
    parser.add_argument("--desync_check", action="store_true")
    parser.add_argument("--ckpt_path", default=None, help="resume from this checkpoint")
    parser.add_argument("--ckpt_every_n_epochs", type=int, default=1, help="ModelCheckpoint(every_n_epochs=...)")
    parser.add_argument("--step_sleep", type=float, default=0.05, help="seconds added to every training step")
    parser.add_argument("--val_sleep", type=float, default=0.2, help="seconds added to every validation step")
    parser.add_argument("--ckpt_hold", type=float, default=0.0, help="seconds inside the first checkpoint save")
    parser.add_argument("--ckpt_hold_rank", type=int, default=None, help="hold the save on this rank only")
    parser.add_argument("--stall_timeout", type=float, default=None, help="strategy's stall_timeout (default: its own)")
    parser.add_argument("--loop_at", help="RANK:EPOCH:BATCH loop forever in training_step")
    parser.add_argument("--block_loader_at", help="RANK:EPOCH:BATCH the training DataLoader blocks at that batch")
    parser.add_argument("--hold", help="RANK:EPOCH:BATCH:SECONDS sleep at the start of that training batch")
    parser.add_argument("--raise_at", help="RANK:EPOCH:BATCH raise in training_step")
    parser.add_argument("--raise_after_forward_at", help="RANK:EPOCH:BATCH raise in training_step after the forward")
    parser.add_argument("--rank_collective_at", help="RANK:EPOCH:BATCH log(sync_dist=True) on that rank only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = FaultNet(args)
    stall = {} if args.stall_timeout is None else {"stall_timeout": args.stall_timeout}
    strategy = CustomDDPStrategy(timeout=args.timeout, desync_check=args.desync_check, **stall)
    checkpoint = ModelCheckpoint(
        dirpath=args.out / "checkpoints", save_last=True, save_top_k=-1, every_n_epochs=args.ckpt_every_n_epochs
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.max_epochs,
        callbacks=[checkpoint],
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        default_root_dir=args.out,
    )
    events = Events(args.out, trainer.global_rank)
    model.events = events
    events("start", restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    try:
        trainer.fit(model, ckpt_path=args.ckpt_path)
    except SystemExit as stop:
        events("exit", code=stop.code, error=type(stop).__name__)
        raise
    except BaseException as error:
        events("exit", code=1, error=type(error).__name__, message=str(error)[:2000])
        raise
    events("exit", code=0, error=None, step=trainer.global_step, epoch=trainer.current_epoch)


if __name__ == "__main__":
    sys.exit(main())
