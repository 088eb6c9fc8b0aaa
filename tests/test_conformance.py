"""Conformance: ``custom_ddp`` as a drop-in for Lightning's ``ddp`` on modules it was not designed for.

Every case runs on 2 CPU processes (fork + gloo) and is checked against Lightning's documented
behaviour: Lightning's own ``ddp`` (``start_method="fork"``) where the result is defined by the
training math, one process where it is defined by the data (evaluation metrics: with
``custom_ddp`` each evaluation sample is evaluated exactly once, so metrics are exact, unlike
``ddp``'s padded ``DistributedSampler``). Modules: Lightning's ``BoringModel`` and the small
modules of ``tests/conformance_modules.py``. With fork launching the parent's module receives
rank 0's final weights and ``trainer.validate``/``test`` return rank 0's logged metrics.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from conformance_modules import (
    BATCH_KINDS,
    ClassifierModule,
    ConvBNModule,
    ManualModule,
    RecordEvalOutputs,
    RecordProgress,
    SavePredictions,
    SyncDistModule,
    TinyGAN,
    UnusedParamsModule,
    read_progress,
    read_records,
    seeded_random_dataset,
)
from strategies.custom_ddp import CustomDDPStrategy

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2


# ----------------------------------------------------------------------------- helpers

def _custom(timeout_s: float = 60, **kwargs) -> CustomDDPStrategy:
    return CustomDDPStrategy(start_method="fork", timeout=timedelta(seconds=timeout_s), **kwargs)


def _ddp(**kwargs) -> DDPStrategy:
    return DDPStrategy(start_method="fork", timeout=timedelta(seconds=60), **kwargs)


def _trainer(strategy="auto", devices: int = WORLD_SIZE, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**{**options, **kwargs})


def _one_process(**kwargs) -> pl.Trainer:
    return _trainer("auto", devices=1, **kwargs)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _fit_state(module: pl.LightningModule, strategy, **kwargs) -> dict[str, torch.Tensor]:
    _trainer(strategy, **kwargs).fit(module)
    return _state(module)


def _assert_states_close(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


def _assert_trained(state: dict, initial: dict) -> None:
    assert any(not torch.equal(state[name], initial[name]) for name in initial if state[name].is_floating_point())


def _metrics(result: dict) -> dict[str, float]:
    return {name: float(value) for name, value in result.items()}


def _assert_exact(actual: dict, expected: dict, keys) -> None:
    """Accuracy and counts are ratios of integer counts: bit-exact; mean losses to float rounding."""
    for key in keys:
        assert key in actual, f"{key} not logged; got {sorted(actual)}"
        if "loss" in key:
            assert actual[key] == pytest.approx(expected[key], rel=1e-6, abs=0), key
        else:
            assert actual[key] == expected[key], key


def _assert_each_sample_once(records: list[dict], loader: int, num_samples: int) -> None:
    seen = [record["seen"].get(str(loader), []) for record in records]
    assert sorted(seen[0] + seen[1]) == list(range(num_samples)), seen


# ----------------------------------------------------------------------------- BoringModel

BORING_SAMPLES = 64


def _boring_loader(seed: int, batch_size: int = 1) -> DataLoader:
    return DataLoader(seeded_random_dataset(32, BORING_SAMPLES, seed), batch_size=batch_size)


def test_boring_model_fit_matches_ddp() -> None:
    # BoringModel's own steps, optimizer and StepLR; validation (with sanity check) each epoch.
    def run(strategy):
        torch.manual_seed(0)
        module = BoringModel()
        _trainer(strategy, max_epochs=2).fit(module, train_dataloaders=_boring_loader(1, batch_size=2),
                                              val_dataloaders=_boring_loader(2, batch_size=3))
        return _state(module)

    torch.manual_seed(0)
    initial = _state(BoringModel())
    expected = run(_ddp())
    actual = run(_custom())
    _assert_states_close(actual, expected)
    _assert_trained(actual, initial)


def test_boring_model_with_its_own_dataloaders_runs_every_entry_point() -> None:
    # The unmodified BoringModel and its own RandomDataset loaders (batch size 1, tensor batches).
    trainer = _trainer(_custom(), max_epochs=1, limit_train_batches=4)
    trainer.fit(BoringModel())
    assert trainer.state.finished
    assert trainer.validate(BoringModel(), verbose=False) == [{}]
    assert trainer.test(BoringModel(), verbose=False) == [{}]
    assert trainer.predict(BoringModel()) is None  # fork launching returns no predictions (documented)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_boring_model_evaluates_each_sample_once_with_single_process_outputs(tmp_path, stage: str) -> None:
    torch.manual_seed(0)
    module = BoringModel()
    loader = _boring_loader(3)  # batch size 1: each step output is one sample's loss

    getattr(_trainer(_custom(), callbacks=[RecordEvalOutputs(tmp_path, "x" if stage == "validate" else "y")]),
            stage)(module, dataloaders=loader, verbose=False)
    reference_dir = tmp_path / "one"
    reference_dir.mkdir()
    getattr(_one_process(callbacks=[RecordEvalOutputs(reference_dir, "x" if stage == "validate" else "y")]),
            stage)(module, dataloaders=loader, verbose=False)

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
    _trainer(_custom(), callbacks=[SavePredictions(tmp_path)]).predict(
        module, dataloaders=DataLoader(dataset, batch_size=5), return_predictions=False)

    indices, predictions = [], []
    for rank in range(WORLD_SIZE):
        saved = torch.load(tmp_path / f"predictions_rank{rank}.pt")
        batch_indices = saved["batch_indices"][0]  # one list of batches per dataloader
        assert len(batch_indices) == len(saved["predictions"]) > 0
        for batch, preds in zip(batch_indices, saved["predictions"]):
            assert len(batch) == len(preds)
            indices.extend(batch)
            predictions.append(preds)
    assert sorted(indices) == list(range(BORING_SAMPLES))
    with torch.no_grad():
        expected = module(dataset.data[indices])
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- batch structures

@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_training_on_batch_structure_matches_ddp(kind: str) -> None:
    options = dict(max_epochs=2, limit_val_batches=0)
    expected = _fit_state(ClassifierModule(kind), _ddp(), **options)
    actual = _fit_state(ClassifierModule(kind), _custom(), **options)
    _assert_states_close(actual, expected)
    _assert_trained(actual, _state(ClassifierModule(kind)))


@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_evaluation_on_batch_structure_is_exact(tmp_path, kind: str) -> None:
    # 11 samples in batches of 4 on 2 ranks: every step sees the structure the user's loader makes.
    trainer = _trainer(_custom())
    val = _metrics(trainer.validate(ClassifierModule(kind, out_dir=tmp_path), verbose=False)[0])
    test = _metrics(trainer.test(ClassifierModule(kind, out_dir=tmp_path), verbose=False)[0])
    _assert_exact(val, _metrics(_one_process().validate(ClassifierModule(kind), verbose=False)[0]),
                  ["val_acc", "val_loss", "val_count"])
    _assert_exact(test, _metrics(_one_process().test(ClassifierModule(kind), verbose=False)[0]),
                  ["test_acc", "test_loss", "test_count"])
    assert val["val_count"] == 11 and test["test_count"] == 11
    _assert_each_sample_once(read_records(tmp_path, "val"), 0, 11)
    _assert_each_sample_once(read_records(tmp_path, "test"), 0, 11)


# ----------------------------------------------------------------------------- exact metrics

@pytest.mark.parametrize("stage", ["validate", "test", "fit"])
def test_torchmetrics_on_11_dict_samples_equal_one_process_exactly(tmp_path, stage: str) -> None:
    keys = ["test_acc", "test_loss", "test_count"] if stage == "test" else ["val_acc", "val_loss", "val_count"]
    if stage == "fit":  # sanity check, then validation after training: metrics of rank 0's final weights
        module = ClassifierModule("dict", out_dir=tmp_path)
        trainer = _trainer(_custom(), max_epochs=2, num_sanity_val_steps=2)
        trainer.fit(module)
        actual = _metrics(trainer.callback_metrics)
        module.out_dir = None
        expected = _metrics(_one_process().validate(module, verbose=False)[0])
    else:
        run = getattr(_trainer(_custom()), stage)
        actual = _metrics(run(ClassifierModule("dict", out_dir=tmp_path), verbose=False)[0])
        expected = _metrics(getattr(_one_process(), stage)(ClassifierModule("dict"), verbose=False)[0])
    _assert_exact(actual, expected, keys)
    assert actual[keys[2]] == 11
    _assert_each_sample_once(read_records(tmp_path, "test" if stage == "test" else "val"), 0, 11)


# ----------------------------------------------------------------------------- several val loaders

VAL_SIZES = (11, 7)


@pytest.mark.parametrize("entry", ["validate", "fit"])
def test_several_validation_dataloaders_log_exact_metrics_per_loader(tmp_path, entry: str) -> None:
    module = ClassifierModule(val_sizes=VAL_SIZES, out_dir=tmp_path)
    if entry == "validate":
        results = _trainer(_custom()).validate(module, verbose=False)
        assert len(results) == len(VAL_SIZES)  # one dict per dataloader (documented)
        actual = {key: value for result in results for key, value in _metrics(result).items()}
    else:
        trainer = _trainer(_custom(), max_epochs=1, num_sanity_val_steps=2)
        trainer.fit(module)
        actual = _metrics(trainer.callback_metrics)
    module.out_dir = None
    expected_results = _one_process().validate(module, verbose=False)
    expected = {key: value for result in expected_results for key, value in _metrics(result).items()}
    for i, size in enumerate(VAL_SIZES):
        keys = [f"val_{name}/dataloader_idx_{i}" for name in ("acc", "loss", "count")]
        _assert_exact(actual, expected, keys)
        assert actual[keys[2]] == size
        _assert_each_sample_once(read_records(tmp_path, "val"), i, size)


# ----------------------------------------------------------------------------- sync_dist

def test_sync_dist_log_in_validation_step_is_the_mean_for_even_shards(tmp_path) -> None:
    # 8 samples, batches of 2: 4 samples and 2 equal batches per rank.
    (tmp_path / "custom").mkdir(), (tmp_path / "ddp").mkdir(), (tmp_path / "one").mkdir()
    actual = _trainer(_custom()).validate(SyncDistModule(8, 2, tmp_path / "custom"), verbose=False)[0]["val_loss"]
    ddp = _trainer(_ddp()).validate(SyncDistModule(8, 2, tmp_path / "ddp"), verbose=False)[0]["val_loss"]
    one = _one_process().validate(SyncDistModule(8, 2, tmp_path / "one"), verbose=False)[0]["val_loss"]
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
    result = _trainer(_custom(timeout_s=10)).validate(module, verbose=False)[0]
    value = float(result["val_loss_epoch" if on_step else "val_loss"])
    per_rank = [json.loads((tmp_path / f"losses_rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert all(per_rank) and len(per_rank[0]) + len(per_rank[1]) == 11
    (tmp_path / "one").mkdir()
    one = _one_process().validate(SyncDistModule(11, 5, tmp_path / "one"), verbose=False)[0]["val_loss"]
    assert math.isfinite(value)
    assert value == pytest.approx(float(one), rel=1e-5)


# ----------------------------------------------------------------------------- manual optimization

def test_manual_optimization_matches_ddp() -> None:
    initial = _state(ManualModule())
    expected = _fit_state(ManualModule(), _ddp(), max_epochs=2)
    actual = _fit_state(ManualModule(), _custom(), max_epochs=2)
    _assert_states_close(actual, expected)
    _assert_trained(actual, initial)


def test_manual_optimization_two_optimizers_with_toggle_matches_ddp() -> None:
    # Toggling freezes the other network, so torch DDP needs find_unused_parameters=True.
    initial = _state(TinyGAN())
    expected = _fit_state(TinyGAN(), _ddp(find_unused_parameters=True), max_epochs=2)
    actual = _fit_state(TinyGAN(), _custom(), max_epochs=2)
    _assert_states_close(actual, expected)
    for prefix in ("generator.", "discriminator."):
        _assert_trained(actual, {k: v for k, v in initial.items() if k.startswith(prefix)})


# ----------------------------------------------------------------------------- clipping, accumulation

@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_matches_ddp(algorithm: str) -> None:
    options = dict(max_epochs=2, limit_val_batches=0, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    expected = _fit_state(ClassifierModule(), _ddp(), **options)
    actual = _fit_state(ClassifierModule(), _custom(), **options)
    _assert_states_close(actual, expected)
    unclipped = _fit_state(ClassifierModule(), _custom(), max_epochs=2, limit_val_batches=0)
    assert any(not torch.allclose(actual[k], unclipped[k]) for k in actual)  # clipping took effect


def test_accumulation_with_a_remainder_at_epoch_end_matches_ddp(tmp_path) -> None:
    # 20 samples, batches of 2: 5 batches per rank, accumulate 2 -> steps after batches 2, 4 and 5.
    options = dict(max_epochs=2, limit_val_batches=0, accumulate_grad_batches=2)

    def module():
        return ClassifierModule(train_size=20, batch_size=2)

    expected = _fit_state(module(), _ddp(), **options)
    actual = _fit_state(module(), _custom(), **options)
    _assert_states_close(actual, expected)
    _trainer(_custom(), callbacks=[RecordProgress(tmp_path)], **options).fit(module())
    # 3 optimizer steps per epoch, the last one on the remainder
    assert [record["global_step"] for record in read_progress(tmp_path)] == [6, 6]


# ----------------------------------------------------------------------------- checkpointing

def test_checkpoint_resume_continues_like_an_uninterrupted_run(tmp_path) -> None:
    # AdamW + per-step StepLR + BatchNorm running stats: all must survive the checkpoint. (No
    # comparison with ddp here: with BatchNorm, custom_ddp synchronises the statistics, ddp not.)
    def module():
        return ClassifierModule(train_size=24, batchnorm=True, optimizer="adamw")

    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()

    def run(ckpt_path=None, dirpath=None):
        callbacks = [RecordProgress(progress_dir)]
        if dirpath:
            callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1))
        m = module()
        trainer = _trainer(_custom(), max_epochs=3, enable_checkpointing=bool(dirpath), callbacks=callbacks)
        trainer.fit(m, ckpt_path=ckpt_path)
        return _state(m)

    uninterrupted = run(dirpath=tmp_path)
    first_epoch = next(tmp_path.glob("epoch=0-*.ckpt"))
    checkpoint = torch.load(first_epoch, weights_only=False)
    assert checkpoint["state_dict"].keys() == module().state_dict().keys()  # a plain module's state dict
    module().load_state_dict(checkpoint["state_dict"])  # loads into one process, strict
    assert checkpoint["epoch"] == 0 and checkpoint["optimizer_states"][0]["state"]
    resumed = run(ckpt_path=first_epoch)
    # 2 more epochs of 3 steps after the restored epoch 0: the global step continues at 3
    assert [(r["current_epoch"], r["global_step"]) for r in read_progress(progress_dir)] == [(3, 9), (3, 9)]
    _assert_states_close(resumed, uninterrupted)


# ----------------------------------------------------------------------------- limit_val_batches

@pytest.mark.parametrize("limit", [0.5, 2], ids=["fraction", "int"])
def test_limit_val_batches_runs_the_limited_batches_without_hanging(tmp_path, limit) -> None:
    # 20 validation samples in batches of 2: 10 per rank, 5 batches; limited to 2 per rank.
    module = ClassifierModule(val_sizes=(20,), eval_batch_size=2, out_dir=tmp_path)
    trainer = _trainer(_custom(timeout_s=20), limit_val_batches=limit, num_sanity_val_steps=2)
    trainer.fit(module)
    for stage in ("sanity", "val"):
        records = read_records(tmp_path, stage)
        for record in records:
            assert record["batches"].get("0", 0) == record["num_batches"][0] > 0, (stage, record)
        seen = records[0]["seen"]["0"] + records[1]["seen"]["0"]
        assert len(seen) == len(set(seen)), f"{stage}: a sample was evaluated twice: {seen}"
        if stage == "val":
            assert float(trainer.callback_metrics["val_count"]) == len(seen)
    result = _metrics(_trainer(_custom(timeout_s=20), limit_val_batches=limit).validate(module, verbose=False)[0])
    seen = [i for record in read_records(tmp_path, "val") for i in record["seen"]["0"]]
    assert result["val_count"] == len(seen) == len(set(seen)) == 8


# ----------------------------------------------------------------------------- BatchNorm2d(bias=False)

def test_batchnorm2d_without_bias_matches_one_process_on_the_global_batch() -> None:
    # Per rank 4 images a step, 2 steps; one process: the same 8 images a step.
    actual = _fit_state(ConvBNModule(batch_size=4), _custom(), max_steps=2, use_distributed_sampler=False)
    expected = _fit_state(ConvBNModule(batch_size=8), "auto", devices=1, max_steps=2)
    assert actual.keys() == expected.keys()
    assert "net.1.bias" not in actual
    worst = max(float((actual[k].double() - expected[k].double()).abs().max()) for k in expected)
    assert worst < 1e-5, worst
    assert int(actual["net.1.num_batches_tracked"]) == 2


# ----------------------------------------------------------------------------- unused parameters

def test_unused_parameters_train_and_match_ddp_find_unused() -> None:
    initial = _state(UnusedParamsModule())
    expected = _fit_state(UnusedParamsModule(), _ddp(find_unused_parameters=True), max_epochs=2)
    actual = _fit_state(UnusedParamsModule(), _custom(), max_epochs=2)
    _assert_states_close(actual, expected)
    assert torch.equal(actual["never_used"], initial["never_used"])  # no rank's gradient: untouched
    assert not torch.equal(actual["rank1_only"], initial["rank1_only"])  # rank 1's gradient, averaged
    _assert_trained(actual, initial)


# ----------------------------------------------------------------------------- evaluating a loaded model

def _trained_checkpoint(tmp_path):
    module = ClassifierModule(batchnorm=True, train_size=24)
    trainer = _one_process(max_epochs=2, limit_val_batches=0)
    trainer.fit(module)
    path = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_validate_from_checkpoint_path_on_a_fresh_module_is_exact(tmp_path) -> None:
    path = _trained_checkpoint(tmp_path)
    actual = _metrics(_trainer(_custom()).validate(ClassifierModule(batchnorm=True, out_dir=tmp_path),
                                                   ckpt_path=path, verbose=False)[0])
    expected = _metrics(_one_process().validate(ClassifierModule(batchnorm=True), ckpt_path=path,
                                                verbose=False)[0])
    _assert_exact(actual, expected, ["val_acc", "val_loss", "val_count"])
    _assert_each_sample_once(read_records(tmp_path, "val"), 0, 11)
    untrained = _metrics(_one_process().validate(ClassifierModule(batchnorm=True), verbose=False)[0])
    assert actual["val_loss"] != untrained["val_loss"]  # the checkpoint's weights were used


def test_test_on_a_module_loaded_in_the_parent_is_exact(tmp_path) -> None:
    path = _trained_checkpoint(tmp_path)
    module = ClassifierModule(batchnorm=True, out_dir=tmp_path)
    module.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    before = _state(module)
    actual = _metrics(_trainer(_custom()).test(module, verbose=False)[0])
    _assert_states_close(_state(module), before, rtol=0, atol=0)  # evaluation changes nothing (BN stats)
    module.out_dir = None
    expected = _metrics(_one_process().test(module, verbose=False)[0])
    _assert_exact(actual, expected, ["test_acc", "test_loss", "test_count"])
    _assert_each_sample_once(read_records(tmp_path, "test"), 0, 11)
