"""Fit, validate, test and predict Lightning's BoringModel on 2 CPU ranks with one strategy.

Run as a script (the popen launcher re-runs ``sys.argv`` per rank; spawn re-imports ``__main__``):

    python tests/launching/start_method_run.py --strategy custom_ddp_spawn --out result.json
    python tests/launching/start_method_run.py --strategy CustomDDPStrategy --start-method forkserver --out r.json
    python tests/launching/start_method_run.py --strategy DDPStrategy --start-method spawn --out r.json

Rank 0 of the launching process writes the fitted weights and the validate/test results to
``--out`` as JSON; each rank writes its predictions (sample index -> output) to
``<out>.predict<rank>.json``, and rank 0 whether the ranks' weights share memory to
``<out>.shared.json``. With ``--check-pickle`` every rank pickles its strategy after setup
(Lightning's own ``ddp`` with popen does not pickle there: its launcher holds the children's locks).
``--no-evaluate`` leaves out validate and test. With ``--release-group`` each stage's workers destroy their
process group at teardown, as ``custom_ddp``'s launcher does (for Lightning's ``ddp`` started with spawn: see
:class:`ReleaseGroup`).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader, TensorDataset

_TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TESTS.parent), str(_TESTS)]  # the repository root, for `strategies`; tests/, for its helpers
from conformance_harness import make_trainer  # noqa: E402

from strategies.custom_ddp import CustomDDPStrategy  # noqa: E402  (registers custom_ddp*)

NUM_SAMPLES = 64  # divisible by 2 ranks x batch 4: ddp's DistributedSampler pads nothing


class LoggingBoringModel(BoringModel):
    """BoringModel on fixed data (identical in every process), logging its evaluation loss."""

    def _loader(self, seed: int) -> DataLoader:
        data = torch.randn(NUM_SAMPLES, 32, generator=torch.Generator().manual_seed(seed))
        return DataLoader(TensorDataset(data), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch[0], batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(batch[0]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.step(batch[0]), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self(batch[0])

    def train_dataloader(self) -> DataLoader:
        return self._loader(1)

    def val_dataloader(self) -> DataLoader:
        return self._loader(2)

    def test_dataloader(self) -> DataLoader:
        return self._loader(3)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(4)


class PredictionsToFile(BasePredictionWriter):
    """Writes each rank's predictions: spawn and fork launchers cannot return them."""

    def __init__(self, out: str) -> None:
        super().__init__(write_interval="epoch")
        self._out = out

    def write_on_epoch_end(self, trainer: Trainer, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        rows = {
            int(i): p.tolist()
            for batch, idx in zip(predictions, batch_indices[0], strict=True)
            for i, p in zip(idx, batch, strict=True)
        }
        Path(f"{self._out}.predict{trainer.global_rank}.json").write_text(json.dumps(rows))


class WeightSharing(Callback):
    """Whether rank 0 sees a change rank 1 makes to its own weights (memory shared between the ranks).

    Written by rank 0 to ``<out>.shared.json`` at the start of training; rank 1 restores its weight
    exactly before any step, so training is unchanged either way.
    """

    def __init__(self, out: str) -> None:
        self._out = out

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        param = next(pl_module.parameters())
        saved = param.detach().clone()
        trainer.strategy.barrier()
        if trainer.global_rank == 1:
            param.data.add_(1000.0)
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            Path(f"{self._out}.shared.json").write_text(json.dumps(not torch.equal(param.detach(), saved)))
        trainer.strategy.barrier()
        if trainer.global_rank == 1:
            param.data.copy_(saved)
        trainer.strategy.barrier()


class StrategyPickles(Callback):
    """Pickles the strategy on every rank after its setup: spawn pickles it into each new process."""

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        pickle.dumps(trainer.strategy)  # raises, and fails the run, when something on it does not pickle


class ReleaseGroup(Callback):
    """Destroys the process group at the end of each stage, in the stage's worker processes.

    A spawned worker of Lightning's ``ddp`` exits through interpreter finalization with gloo's threads
    still alive and then often aborts ("terminate called without an active exception", SIGABRT, in 3 of
    8 runs of this script on a quiet 2-core machine) after its stage succeeded. ``custom_ddp``'s
    launcher destroys the group itself (:mod:`strategies.launchers`); this gives Lightning's reference
    runs the same clean exit without changing what they compute. Spawn only: there every stage starts
    new processes, while popen ranks keep their group for the next stage.
    """

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _strategy(name: str, start_method: str | None) -> str | Strategy:
    classes = {"CustomDDPStrategy": CustomDDPStrategy, "DDPStrategy": DDPStrategy}
    if name in classes:
        return classes[name](start_method=start_method or "popen")
    return name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--start-method", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--check-pickle", action="store_true", help="every rank pickles its strategy after setup")
    parser.add_argument("--release-group", action="store_true", help="destroy the process group at each stage's end")
    parser.add_argument("--evaluate", action=argparse.BooleanOptionalAction, default=True, help="validate and test")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LoggingBoringModel()
    callbacks: list[Callback] = [
        PredictionsToFile(args.out),
        WeightSharing(args.out),
        *([StrategyPickles()] if args.check_pickle else []),
        *([ReleaseGroup()] if args.release_group else []),
    ]
    strategy = _strategy(args.strategy, args.start_method)
    trainer = make_trainer(strategy, max_epochs=2, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model)
    evaluated = (
        {"validate": trainer.validate(model, verbose=False), "test": trainer.test(model, verbose=False)}
        if args.evaluate
        else {}
    )
    trainer.predict(model, return_predictions=False)
    if trainer.global_rank == 0:
        result = {
            "strategy": type(trainer.strategy).__name__,
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
            **evaluated,
        }
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
