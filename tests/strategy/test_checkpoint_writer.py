"""Only the checkpoint's writer calls ``torch.save``, as under ``ddp`` (Lightning's own
``test_model_checkpoint_no_extraneous_invocations`` checks it of every strategy it runs).

``custom_ddp`` saves every rank's random generators into each checkpoint (``exact_resume``): they are gathered
encoded (``parallel.resume.rng_state.gather_rng_states``), because ``all_gather_object`` pickles tensors through
``torch.save`` on every rank; rank 1 then called it once per checkpoint."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
from conformance_harness import make_trainer
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from strategies import CustomDDPStrategy

EPOCHS = 3


class CountedSaves(ModelCheckpoint):
    """A checkpoint every epoch; from the start of training each rank counts its own ``torch.save`` calls."""

    def on_train_start(self, trainer: Trainer, pl_module: BoringModel) -> None:
        torch.save = Mock(wraps=torch.save)  # a forked worker's own module attribute: this rank's calls only

    def on_train_end(self, trainer: Trainer, pl_module: BoringModel) -> None:
        super().on_train_end(trainer, pl_module)
        assert torch.save.call_count == (EPOCHS if trainer.is_global_zero else 0), trainer.global_rank


@pytest.mark.distributed
def test_only_rank_0_calls_torch_save(tmp_path: Path) -> None:
    trainer = make_trainer(
        CustomDDPStrategy(start_method="fork"),
        max_epochs=EPOCHS,
        limit_train_batches=2,
        limit_val_batches=1,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        callbacks=[CountedSaves(dirpath=tmp_path / "ckpts", save_top_k=-1)],
    )
    trainer.fit(BoringModel())  # a failed count raises in that worker and fails the fit
    assert len(list((tmp_path / "ckpts").glob("*.ckpt"))) == EPOCHS
