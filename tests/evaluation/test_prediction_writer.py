"""callbacks.PredictionWriter: one file per predict run (merged, dataset order) or one per rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conformance_harness import one_process_trainer
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from callbacks import PredictionWriter
from callbacks.prediction_writer import _collate, _merge


class Doubler(LightningModule):
    """predict_step returns a plain tensor (2 x input), or a dict with it when ``as_dict``."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.as_dict = as_dict

    def predict_step(self, batch, batch_idx):
        (x,) = batch
        return {"double": 2 * x, "first": x[:, 0]} if self.as_dict else 2 * x


def _predict(tmp_path: Path, model: LightningModule, writer: PredictionWriter, n: int = 10):
    data = DataLoader(TensorDataset(torch.arange(n * 3, dtype=torch.float32).view(n, 3)), batch_size=4)
    trainer = one_process_trainer(enable_checkpointing=True, default_root_dir=tmp_path, callbacks=[writer])
    trainer.predict(model, data, return_predictions=False)
    return data.dataset.tensors[0]


def test_writes_tensor_predictions_with_indices_to_the_default_path(tmp_path: Path) -> None:
    writer = PredictionWriter()
    inputs = _predict(tmp_path, Doubler(), writer)
    assert writer.written == [tmp_path / "predictions.pt"]  # no logger: the Trainer's default_root_dir
    saved = torch.load(tmp_path / "predictions.pt")
    assert torch.equal(saved["index"], torch.arange(10)) and torch.equal(saved["prediction"], 2 * inputs)


@pytest.mark.parametrize("merge", [True, False])
def test_dict_predictions_to_a_given_path_merged_or_per_rank(tmp_path: Path, merge: bool) -> None:
    path = tmp_path / "out" / "preds.pt"
    writer = PredictionWriter(output_path=str(path), merge=merge)
    inputs = _predict(tmp_path, Doubler(as_dict=True), writer)
    expected = path if merge else path.with_name("preds_rank0.pt")
    assert writer.written == [expected]
    saved = torch.load(expected)
    assert torch.equal(saved["double"], 2 * inputs) and torch.equal(saved["first"], inputs[:, 0])


def test_merge_sorts_ranks_rows_by_dataset_index_and_skips_an_empty_rank() -> None:
    # DistributedSampler-style interleaving: rank 0 had items 0, 2, 4; rank 1 had 1, 3; rank 2 none.
    parts = [
        _collate([{"p": torch.tensor([0.0, 2.0])}, {"p": torch.tensor([4.0])}], [[0, 2], [4]]),
        _collate([{"p": torch.tensor([1.0, 3.0])}], [[1, 3]]),
        _collate([], []),
    ]
    merged = _merge(parts)
    assert torch.equal(merged["index"], torch.arange(5)) and torch.equal(merged["p"], torch.arange(5.0))


def test_outputs_that_are_not_tensors_are_rejected_with_the_fix() -> None:
    with pytest.raises(TypeError, match="predict_step returned list"):
        _collate([[1, 2]], [[0, 1]])
    with pytest.raises(ValueError, match="batch dimension first"):
        _collate([{"p": torch.zeros(3)}], [[0, 1]])
