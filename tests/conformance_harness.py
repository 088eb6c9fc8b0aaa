"""What the tests that run Lightning share: the strategies as each test builds them (fork + gloo, 2 processes),
the quiet CPU trainer (2 ranks, or one process) every such test starts from, the comparisons of weights and
metrics (``tests/lightning_conformance/``'s fit and eval tests, and the custom_ddp, resume, stop and
collective-count tests), and a stand-in for rank 0's trainer in a fit (LastCheckpoint's tests)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from conformance_data import seeded_random_dataset
from lightning.pytorch.loops.progress import _BatchProgress
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from strategies.custom_ddp import CustomDDPStrategy

WORLD_SIZE = 2


def custom_strategy(timeout_s: float = 60, start_method: str = "fork", **kwargs) -> CustomDDPStrategy:
    return CustomDDPStrategy(start_method=start_method, timeout=timedelta(seconds=timeout_s), **kwargs)


def ddp_strategy(**kwargs) -> DDPStrategy:
    return DDPStrategy(start_method="fork", timeout=timedelta(seconds=60), **kwargs)


def make_trainer(strategy="auto", devices: int = WORLD_SIZE, **kwargs) -> pl.Trainer:
    """A CPU trainer for one epoch without logger, checkpoints, progress bar or model summary; ``kwargs`` override
    or add to these (a test with a ``ModelCheckpoint`` callback passes ``enable_checkpointing=True``)."""
    options = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**options, **kwargs})


def one_process_trainer(**kwargs) -> pl.Trainer:
    return make_trainer("auto", devices=1, **kwargs)


def rank_0_fitting(global_step: int, current_epoch: int, progress: _BatchProgress) -> SimpleNamespace:
    """A stand-in for rank 0's trainer in a fit, with what LastCheckpoint reads: the step, the epoch and the batch
    counters (``progress``) where Lightning keeps them."""
    return SimpleNamespace(
        is_global_zero=True,
        global_rank=0,
        global_step=global_step,
        current_epoch=current_epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def fit_state(module: pl.LightningModule, strategy, **kwargs) -> dict[str, torch.Tensor]:
    make_trainer(strategy, **kwargs).fit(module)
    return state_of(module)


def assert_states_close(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


def assert_trained(state: dict, initial: dict) -> None:
    assert any(not torch.equal(state[name], initial[name]) for name in initial if state[name].is_floating_point())


def metrics_of(result: dict) -> dict[str, float]:
    return {name: float(value) for name, value in result.items()}


def assert_exact(actual: dict, expected: dict, keys) -> None:
    """Accuracy and counts are ratios of integer counts: bit-exact; mean losses to float rounding."""
    for key in keys:
        assert key in actual, f"{key} not logged; got {sorted(actual)}"
        if "loss" in key:
            assert actual[key] == pytest.approx(expected[key], rel=1e-6, abs=0), key
        else:
            assert actual[key] == expected[key], key


def assert_each_sample_once(records: list[dict], loader: int, num_samples: int) -> None:
    seen = [record["seen"].get(str(loader), []) for record in records]
    assert sorted(seen[0] + seen[1]) == list(range(num_samples)), seen


BORING_SAMPLES = 64


def boring_loader(seed: int, batch_size: int = 1) -> DataLoader:
    return DataLoader(seeded_random_dataset(32, BORING_SAMPLES, seed), batch_size=batch_size)
