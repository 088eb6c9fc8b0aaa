"""LitClassifier: options, schedules, and 1-epoch fits (1 process and Lightning DDP on 2 CPU processes)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conformance_harness import make_trainer, one_process_trainer
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_cifar.errors import OptionError
from lit_cifar.module import LitClassifier, _warmup_cosine

EPOCH_TAGS = {"train/loss_epoch", "train/acc1_epoch", "train/acc5_epoch", "val/loss", "val/acc1", "val/acc5"}


def _fit(tmp_path: Path, datamodule, strategy="auto", devices: int = 1) -> Trainer:
    model = LitClassifier(net="template", lr=0.05, schedule="cosine", warmup_fraction=0.2)
    trainer = make_trainer(
        strategy,
        devices,
        log_every_n_steps=1,
        logger=TensorBoardLogger(tmp_path, name="lightning_logs", default_hp_metric=False),
    )
    trainer.fit(model, datamodule=datamodule)
    return trainer


def _scalars(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def test_fit_one_process_logs_metrics_and_dataset(tmp_path: Path, tiny_datamodule) -> None:
    datamodule = tiny_datamodule()
    trainer = _fit(tmp_path, datamodule)
    log_dir = tmp_path / "lightning_logs" / "version_0"
    events = _scalars(log_dir)
    assert EPOCH_TAGS <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train/loss_step")) == trainer.num_training_batches == 5  # 300 images / 64
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["dataset_used"] == "synthetic" and hparams["net"] == "template"
    # The cosine schedule ran to its end (per-step scheduler, all estimated steps taken).
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-3)

    (test_metrics,) = trainer.test(trainer.lightning_module, datamodule=datamodule, verbose=False)
    assert {"test/loss", "test/acc1", "test/acc5"} <= set(test_metrics)
    assert 0.0 <= test_metrics["test/acc1"] <= test_metrics["test/acc5"] <= 1.0


@pytest.mark.distributed
def test_fit_ddp_two_cpu_processes(tmp_path: Path, tiny_datamodule) -> None:
    trainer = _fit(tmp_path, tiny_datamodule(), strategy="ddp_fork", devices=2)
    events = _scalars(tmp_path / "lightning_logs" / "version_0")
    assert EPOCH_TAGS <= set(events.Tags()["scalars"])
    # DistributedSampler halves the epoch: 150 images per rank / 64 -> 3 steps (5 in one process).
    assert len(events.Scalars("train/loss_step")) == 3
    assert math.isfinite(trainer.callback_metrics["val/acc1"].item())


def test_predict_step_returns_classes_top5_probabilities_and_targets() -> None:
    model = LitClassifier(net="template").eval()
    images, labels = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.arange(6)
    with torch.no_grad():
        out = model.predict_step((images, labels), 0)
        logits = model(images)
    assert set(out) == {"pred", "top5", "probs", "target"}
    torch.testing.assert_close(out["probs"], logits.softmax(dim=-1))
    assert torch.equal(out["pred"], logits.argmax(dim=-1)) and torch.equal(out["target"], labels)
    assert out["top5"].shape == (6, 5) and torch.equal(out["top5"], logits.topk(5, dim=-1).indices)


@pytest.mark.parametrize("total_steps", [1, 2, 4, 5, 10])
def test_onecycle_survives_a_one_step_rise(total_steps: int) -> None:
    # warmup_fraction * total_steps == 1 made torch's OneCycleLR divide by zero at construction.
    model = LitClassifier(
        net="template", schedule="onecycle", warmup_fraction=1 / total_steps if total_steps > 1 else 0.5
    )
    model.trainer = SimpleNamespace(estimated_stepping_batches=total_steps)
    config = model.configure_optimizers()
    scheduler, optimizer = config["lr_scheduler"]["scheduler"], config["optimizer"]
    for _ in range(total_steps):
        optimizer.step()
        scheduler.step()
    assert math.isfinite(optimizer.param_groups[0]["lr"])


def test_param_groups_exclude_biases_and_norms_from_weight_decay() -> None:
    model = LitClassifier(net="template", weight_decay=1e-3)
    decay, no_decay = model.param_groups()
    assert decay["weight_decay"] == 1e-3 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_warmup_cosine_factor() -> None:
    factor = _warmup_cosine(warmup_steps=10, total_steps=110)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.5) and factor(110) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"net": "vgg"}, "unknown net"),
        ({"optimizer": "lamb"}, "optimizer must be one of"),
        ({"schedule": "step"}, "schedule one of"),
        ({"momentum": 0.0, "nesterov": True}, "nesterov=True needs momentum"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
    ],
)
def test_bad_options_are_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        LitClassifier(**kwargs)


@pytest.mark.parametrize("net", ["template", "resnet18"])
def test_model_summary_counts_flops_through_the_datamodule_hook(net: str, tiny_datamodule) -> None:
    """example_input_array gives Lightning's summary real FLOPs (not 0) and sizes; the DataModule's batch
    hook, which the summary sends it through, passes a bare tensor unchanged."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    model = LitClassifier(net=net, net_kwargs={"width": 0.25} if net == "resnet18" else None)
    summary = ModelSummary(model, max_depth=1)
    assert summary.total_flops > 0 and summary.out_sizes[0] == [1, 100]
    datamodule = tiny_datamodule()
    assert datamodule.on_after_batch_transfer(model.example_input_array, 0) is model.example_input_array


@pytest.mark.parametrize("schedule", ["onecycle", "cosine"])
def test_a_resume_with_a_longer_fit_names_the_schedule_it_cannot_continue(
    tmp_path: Path, tiny_datamodule, schedule: str
) -> None:
    """OneCycleLR keeps the checkpoint's total_steps (torch then fails at step 6 of 10): an error before
    training says why and what to do; a cosine schedule is rebuilt for the new length: a warning."""

    def fit(max_epochs: int, ckpt_path: Path | None = None) -> None:
        trainer = one_process_trainer(max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=tmp_path)
        trainer.fit(
            LitClassifier(net="template", lr=0.05, schedule=schedule), datamodule=tiny_datamodule(), ckpt_path=ckpt_path
        )

    fit(1)
    (checkpoint,) = (tmp_path / "checkpoints").glob("*.ckpt")
    if schedule == "onecycle":
        with pytest.raises(
            OptionError,
            match="onecycle schedule built for 5 optimizer steps into a fit of 10 .*"
            "Resume with the interrupted fit's --trainer.max_epochs",
        ):
            fit(2, checkpoint)
    else:
        with pytest.warns(
            UserWarning,
            match="cosine schedule built for 5 optimizer steps into a fit of 10 .* from "
            "step 5 on its learning rate does not continue",
        ):
            fit(2, checkpoint)
