"""The summary a fit ends with says why no validation result is there, in the flag that caused it."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_cifar.cli.fit_summary import fit_summary


class NoValidationLoader(BoringModel):
    val_dataloader = None  # Lightning: no validation loop at all


def _summary_line(tmp_path: Path, model: BoringModel, **flags) -> str:
    flags = {"max_epochs": 1, "limit_train_batches": 4, **flags}
    trainer = Trainer(
        accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False, **flags
    )
    trainer.fit(model)
    (line,) = [line for line in fit_summary(trainer, None, 1.0, "auto").splitlines() if line.startswith("  validation")]
    return line.removeprefix("  validation  ")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"limit_val_batches": 0}, "none ran: limit_val_batches=0"),
        ({"max_steps": 2}, "none ran: the fit ended at max_steps=2, before the first validation (at each epoch's end)"),
        (
            {"max_epochs": 2, "check_val_every_n_epoch": 3},
            "none ran: the fit ended after 2 epoch(s), 8 optimizer steps, before the first validation "
            "(every 3 epochs (check_val_every_n_epoch=3))",
        ),
        (
            {"max_steps": 2, "val_check_interval": 3},
            "none ran: the fit ended at max_steps=2, before the first validation "
            "(every 3 training batches (val_check_interval=3))",
        ),
    ],
    ids=["limit_val_batches", "max_steps", "check_val_every_n_epoch", "val_check_interval"],
)
def test_the_validation_line_names_why_none_ran(tmp_path: Path, flags: dict, says: str) -> None:
    assert _summary_line(tmp_path, BoringModel(), num_sanity_val_steps=0, **flags) == says


def test_a_module_without_a_validation_loader_is_named(tmp_path: Path) -> None:
    assert _summary_line(tmp_path, NoValidationLoader()) == "none ran: the data has no validation loader"
