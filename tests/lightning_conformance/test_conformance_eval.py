"""Conformance, evaluation: ``custom_ddp`` evaluates modules it was not designed for exactly.

Every case runs on 2 CPU processes (fork + gloo) against one process, where the result is defined by
the data: with ``custom_ddp`` each evaluation sample is evaluated exactly once, so metrics are exact,
unlike ``ddp``'s padded ``DistributedSampler``. Modules: Lightning's ``BoringModel`` and the small modules
of ``conformance_modules.py`` beside this file. With fork launching ``trainer.validate``/``test`` return rank 0's
logged metrics. Training: ``test_conformance_fit.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conformance_callbacks import RecordEvalOutputs, SavePredictions
from conformance_data import BATCH_KINDS, seeded_random_dataset
from conformance_harness import (
    BORING_SAMPLES,
    WORLD_SIZE,
    assert_each_sample_once,
    assert_exact,
    assert_states_close,
    boring_loader,
    custom_strategy,
    ddp_strategy,
    make_trainer,
    metrics_of,
    one_process_trainer,
    state_of,
)
from conformance_modules import ClassifierModule, SyncDistModule, read_records
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

pytestmark = pytest.mark.distributed


# ----------------------------------------------------------------------------- BoringModel


def test_boring_model_with_its_own_dataloaders_runs_every_entry_point() -> None:
    # The unmodified BoringModel and its own RandomDataset loaders (batch size 1, tensor batches).
    trainer = make_trainer(custom_strategy(), max_epochs=1, limit_train_batches=4)
    trainer.fit(BoringModel())
    assert trainer.state.finished
    assert trainer.validate(BoringModel(), verbose=False) == [{}]
    assert trainer.test(BoringModel(), verbose=False) == [{}]
    assert trainer.predict(BoringModel()) is None  # fork launching returns no predictions (documented)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_boring_model_evaluates_each_sample_once_with_single_process_outputs(tmp_path, stage: str) -> None:
    torch.manual_seed(0)
    module = BoringModel()
    loader = boring_loader(3)  # batch size 1: each step output is one sample's loss

    key = "x" if stage == "validate" else "y"
    getattr(make_trainer(custom_strategy(), callbacks=[RecordEvalOutputs(tmp_path, key)]), stage)(
        module, dataloaders=loader, verbose=False
    )
    reference_dir = tmp_path / "one"
    reference_dir.mkdir()
    getattr(one_process_trainer(callbacks=[RecordEvalOutputs(reference_dir, key)]), stage)(
        module, dataloaders=loader, verbose=False
    )

    def by_sample(records):
        rows = torch.cat([row for record in records for row in record["rows"]])
        outputs = torch.cat([out for record in records for out in record["outputs"]])
        order = torch.argsort(rows[:, 0])
        return rows[order], outputs[order]

    ranks = [torch.load(tmp_path / f"{stage}_rank{rank}.pt") for rank in range(WORLD_SIZE)]
    assert all(len(record["rows"]) > 0 for record in ranks)
    rows, outputs = by_sample(ranks)
    expected_rows, expected_outputs = by_sample([torch.load(reference_dir / f"{stage}_rank0.pt")])
    assert rows.shape == (BORING_SAMPLES, 32)  # every sample, none twice
    torch.testing.assert_close(rows, expected_rows, rtol=0, atol=0)
    torch.testing.assert_close(outputs, expected_outputs, rtol=1e-6, atol=1e-7)


def test_boring_model_predict_has_an_output_for_every_sample_once(tmp_path) -> None:
    torch.manual_seed(0)
    module = BoringModel()
    dataset = seeded_random_dataset(32, BORING_SAMPLES, 4)
    make_trainer(custom_strategy(), callbacks=[SavePredictions(tmp_path)]).predict(
        module, dataloaders=DataLoader(dataset, batch_size=5), return_predictions=False
    )

    indices, predictions = [], []
    for rank in range(WORLD_SIZE):
        saved = torch.load(tmp_path / f"predictions_rank{rank}.pt")
        batch_indices = saved["batch_indices"][0]  # one list of batches per dataloader
        assert len(batch_indices) == len(saved["predictions"]) > 0
        for batch, preds in zip(batch_indices, saved["predictions"], strict=True):
            assert len(batch) == len(preds)
            indices.extend(batch)
            predictions.append(preds)
    assert sorted(indices) == list(range(BORING_SAMPLES))
    with torch.no_grad():
        expected = module(dataset.data[indices])
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- batch structures


@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_evaluation_on_batch_structure_is_exact(tmp_path, kind: str) -> None:
    # 11 samples in batches of 4 on 2 ranks: every step sees the structure the user's loader makes.
    trainer = make_trainer(custom_strategy())
    val = metrics_of(trainer.validate(ClassifierModule(kind, out_dir=tmp_path), verbose=False)[0])
    test = metrics_of(trainer.test(ClassifierModule(kind, out_dir=tmp_path), verbose=False)[0])
    assert_exact(
        val,
        metrics_of(one_process_trainer().validate(ClassifierModule(kind), verbose=False)[0]),
        ["val_acc", "val_loss", "val_count"],
    )
    assert_exact(
        test,
        metrics_of(one_process_trainer().test(ClassifierModule(kind), verbose=False)[0]),
        ["test_acc", "test_loss", "test_count"],
    )
    assert val["val_count"] == 11 and test["test_count"] == 11
    assert_each_sample_once(read_records(tmp_path, "val"), 0, 11)
    assert_each_sample_once(read_records(tmp_path, "test"), 0, 11)


# ----------------------------------------------------------------------------- exact metrics


@pytest.mark.parametrize("stage", ["validate", "test", "fit"])
def test_torchmetrics_on_11_dict_samples_equal_one_process_exactly(tmp_path, stage: str) -> None:
    keys = ["test_acc", "test_loss", "test_count"] if stage == "test" else ["val_acc", "val_loss", "val_count"]
    if stage == "fit":  # sanity check, then validation after training: metrics of rank 0's final weights
        module = ClassifierModule("dict", out_dir=tmp_path)
        trainer = make_trainer(custom_strategy(), max_epochs=2, num_sanity_val_steps=2)
        trainer.fit(module)
        actual = metrics_of(trainer.callback_metrics)
        module.out_dir = None
        expected = metrics_of(one_process_trainer().validate(module, verbose=False)[0])
    else:
        run = getattr(make_trainer(custom_strategy()), stage)
        actual = metrics_of(run(ClassifierModule("dict", out_dir=tmp_path), verbose=False)[0])
        expected = metrics_of(getattr(one_process_trainer(), stage)(ClassifierModule("dict"), verbose=False)[0])
    assert_exact(actual, expected, keys)
    assert actual[keys[2]] == 11
    assert_each_sample_once(read_records(tmp_path, "test" if stage == "test" else "val"), 0, 11)


# ----------------------------------------------------------------------------- several val loaders

VAL_SIZES = (11, 7)


@pytest.mark.parametrize("entry", ["validate", "fit"])
def test_several_validation_dataloaders_log_exact_metrics_per_loader(tmp_path, entry: str) -> None:
    module = ClassifierModule(val_sizes=VAL_SIZES, out_dir=tmp_path)
    if entry == "validate":
        results = make_trainer(custom_strategy()).validate(module, verbose=False)
        assert len(results) == len(VAL_SIZES)  # one dict per dataloader (documented)
        actual = {key: value for result in results for key, value in metrics_of(result).items()}
    else:
        trainer = make_trainer(custom_strategy(), max_epochs=1, num_sanity_val_steps=2)
        trainer.fit(module)
        actual = metrics_of(trainer.callback_metrics)
    module.out_dir = None
    expected_results = one_process_trainer().validate(module, verbose=False)
    expected = {key: value for result in expected_results for key, value in metrics_of(result).items()}
    for i, size in enumerate(VAL_SIZES):
        keys = [f"val_{name}/dataloader_idx_{i}" for name in ("acc", "loss", "count")]
        assert_exact(actual, expected, keys)
        assert actual[keys[2]] == size
        assert_each_sample_once(read_records(tmp_path, "val"), i, size)


# ----------------------------------------------------------------------------- sync_dist


def test_sync_dist_log_in_validation_step_is_the_mean_for_even_shards(tmp_path) -> None:
    # 8 samples, batches of 2: 4 samples and 2 equal batches per rank.
    (tmp_path / "custom").mkdir(), (tmp_path / "ddp").mkdir(), (tmp_path / "one").mkdir()
    custom = make_trainer(custom_strategy())
    actual = custom.validate(SyncDistModule(8, 2, tmp_path / "custom"), verbose=False)[0]["val_loss"]
    ddp = make_trainer(ddp_strategy()).validate(SyncDistModule(8, 2, tmp_path / "ddp"), verbose=False)[0]["val_loss"]
    one = one_process_trainer().validate(SyncDistModule(8, 2, tmp_path / "one"), verbose=False)[0]["val_loss"]
    losses = json.loads((tmp_path / "one" / "losses_rank0.json").read_text())
    assert len(losses) == 8
    assert float(one) == pytest.approx(sum(losses) / 8, rel=1e-6)
    assert float(actual) == pytest.approx(float(one), rel=1e-5)
    assert float(actual) == pytest.approx(float(ddp), rel=1e-5)
    custom_losses = [json.loads((tmp_path / "custom" / f"losses_rank{r}.json").read_text()) for r in range(2)]
    assert sorted(custom_losses[0] + custom_losses[1]) == pytest.approx(sorted(losses), rel=1e-6)


@pytest.mark.parametrize("on_step", [False, True], ids=["on_epoch", "on_step_and_epoch"])
def test_sync_dist_log_in_validation_step_on_uneven_shards_is_exact_and_does_not_hang(tmp_path, on_step: bool) -> None:
    # 11 samples in batches of 5: the shards differ in size and in batch count (Lightning's ddp
    # pads to 6 + 6 instead: 2 batches per rank). A hang becomes a collective timeout error after
    # 10 s instead of blocking the suite. Lightning's epoch value of a mean with sync_dist is
    # sum(batch mean * batch size) / sum(batch size) over all ranks' batches: with each sample
    # evaluated once, that is the exact mean over the 11 samples.
    module = SyncDistModule(11, 5, tmp_path, on_step=on_step)
    result = make_trainer(custom_strategy(timeout_s=10)).validate(module, verbose=False)[0]
    value = float(result["val_loss_epoch" if on_step else "val_loss"])
    per_rank = [json.loads((tmp_path / f"losses_rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert all(per_rank) and len(per_rank[0]) + len(per_rank[1]) == 11
    (tmp_path / "one").mkdir()
    one = one_process_trainer().validate(SyncDistModule(11, 5, tmp_path / "one"), verbose=False)[0]["val_loss"]
    assert math.isfinite(value)
    assert value == pytest.approx(float(one), rel=1e-5)


# ----------------------------------------------------------------------------- limit_val_batches


@pytest.mark.parametrize("limit", [0.5, 2], ids=["fraction", "int"])
def test_limit_val_batches_runs_the_limited_batches_without_hanging(tmp_path, limit) -> None:
    # 20 validation samples in batches of 2: 10 per rank, 5 batches; limited to 2 per rank.
    module = ClassifierModule(val_sizes=(20,), eval_batch_size=2, out_dir=tmp_path)
    trainer = make_trainer(custom_strategy(timeout_s=20), limit_val_batches=limit, num_sanity_val_steps=2)
    trainer.fit(module)
    for stage in ("sanity", "val"):
        records = read_records(tmp_path, stage)
        for record in records:
            assert record["batches"].get("0", 0) == record["num_batches"][0] > 0, (stage, record)
        seen = records[0]["seen"]["0"] + records[1]["seen"]["0"]
        assert len(seen) == len(set(seen)), f"{stage}: a sample was evaluated twice: {seen}"
        if stage == "val":
            assert float(trainer.callback_metrics["val_count"]) == len(seen)
    limited = make_trainer(custom_strategy(timeout_s=20), limit_val_batches=limit)
    result = metrics_of(limited.validate(module, verbose=False)[0])
    seen = [i for record in read_records(tmp_path, "val") for i in record["seen"]["0"]]
    assert result["val_count"] == len(seen) == len(set(seen)) == 8


# ----------------------------------------------------------------------------- evaluating a loaded model


def _trained_checkpoint(tmp_path):
    module = ClassifierModule(batchnorm=True, train_size=24)
    trainer = one_process_trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(module)
    path = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_validate_from_checkpoint_path_on_a_fresh_module_is_exact(tmp_path) -> None:
    path = _trained_checkpoint(tmp_path)
    actual = metrics_of(
        make_trainer(custom_strategy()).validate(
            ClassifierModule(batchnorm=True, out_dir=tmp_path), ckpt_path=path, verbose=False
        )[0]
    )
    expected = metrics_of(
        one_process_trainer().validate(ClassifierModule(batchnorm=True), ckpt_path=path, verbose=False)[0]
    )
    assert_exact(actual, expected, ["val_acc", "val_loss", "val_count"])
    assert_each_sample_once(read_records(tmp_path, "val"), 0, 11)
    untrained = metrics_of(one_process_trainer().validate(ClassifierModule(batchnorm=True), verbose=False)[0])
    assert actual["val_loss"] != untrained["val_loss"]  # the checkpoint's weights were used


def test_test_on_a_module_loaded_in_the_parent_is_exact(tmp_path) -> None:
    path = _trained_checkpoint(tmp_path)
    module = ClassifierModule(batchnorm=True, out_dir=tmp_path)
    module.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    before = state_of(module)
    actual = metrics_of(make_trainer(custom_strategy()).test(module, verbose=False)[0])
    assert_states_close(state_of(module), before, rtol=0, atol=0)  # evaluation changes nothing (BN stats)
    module.out_dir = None
    expected = metrics_of(one_process_trainer().test(module, verbose=False)[0])
    assert_exact(actual, expected, ["test_acc", "test_loss", "test_count"])
    assert_each_sample_once(read_records(tmp_path, "test"), 0, 11)
