"""Conformance, training: ``custom_ddp`` trains modules it was not designed for to ``ddp``'s weights.

Every case runs on 2 CPU processes (fork + gloo) against Lightning's own ``ddp``
(``start_method="fork"``), or one process on the global batch where ``ddp`` differs by design (BatchNorm
statistics). Modules: Lightning's ``BoringModel`` and the small modules of ``conformance_modules.py`` beside this
file.
With fork launching the parent's module receives rank 0's final weights. Evaluation: ``test_conformance_eval.py``.
"""

from __future__ import annotations

import pytest
import torch
from conformance_callbacks import RecordProgress, read_progress
from conformance_data import BATCH_KINDS
from conformance_harness import (
    assert_states_close,
    assert_trained,
    boring_loader,
    custom_strategy,
    ddp_strategy,
    fit_state,
    make_trainer,
    state_of,
)
from conformance_modules import ClassifierModule, ConvBNModule, ManualModule, TinyGAN, UnusedParamsModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

pytestmark = pytest.mark.distributed


# ----------------------------------------------------------------------------- BoringModel


def test_boring_model_fit_matches_ddp() -> None:
    # BoringModel's own steps, optimizer and StepLR; validation (with sanity check) each epoch.
    def run(strategy):
        torch.manual_seed(0)
        module = BoringModel()
        make_trainer(strategy, max_epochs=2).fit(
            module, train_dataloaders=boring_loader(1, batch_size=2), val_dataloaders=boring_loader(2, batch_size=3)
        )
        return state_of(module)

    torch.manual_seed(0)
    initial = state_of(BoringModel())
    expected = run(ddp_strategy())
    actual = run(custom_strategy())
    assert_states_close(actual, expected)
    assert_trained(actual, initial)


# ----------------------------------------------------------------------------- batch structures


@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_training_on_batch_structure_matches_ddp(kind: str) -> None:
    options = dict(max_epochs=2, limit_val_batches=0)
    expected = fit_state(ClassifierModule(kind), ddp_strategy(), **options)
    actual = fit_state(ClassifierModule(kind), custom_strategy(), **options)
    assert_states_close(actual, expected)
    assert_trained(actual, state_of(ClassifierModule(kind)))


# ----------------------------------------------------------------------------- manual optimization


def test_manual_optimization_matches_ddp() -> None:
    initial = state_of(ManualModule())
    expected = fit_state(ManualModule(), ddp_strategy(), max_epochs=2)
    actual = fit_state(ManualModule(), custom_strategy(), max_epochs=2)
    assert_states_close(actual, expected)
    assert_trained(actual, initial)


def test_manual_optimization_two_optimizers_with_toggle_matches_ddp() -> None:
    # Toggling freezes the other network, so torch DDP needs find_unused_parameters=True.
    initial = state_of(TinyGAN())
    expected = fit_state(TinyGAN(), ddp_strategy(find_unused_parameters=True), max_epochs=2)
    actual = fit_state(TinyGAN(), custom_strategy(), max_epochs=2)
    assert_states_close(actual, expected)
    for prefix in ("generator.", "discriminator."):
        assert_trained(actual, {k: v for k, v in initial.items() if k.startswith(prefix)})


# ----------------------------------------------------------------------------- clipping, accumulation


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_matches_ddp(algorithm: str) -> None:
    options = dict(max_epochs=2, limit_val_batches=0, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    expected = fit_state(ClassifierModule(), ddp_strategy(), **options)
    actual = fit_state(ClassifierModule(), custom_strategy(), **options)
    assert_states_close(actual, expected)
    unclipped = fit_state(ClassifierModule(), custom_strategy(), max_epochs=2, limit_val_batches=0)
    assert any(not torch.allclose(actual[k], unclipped[k]) for k in actual)  # clipping took effect


def test_accumulation_with_a_remainder_at_epoch_end_matches_ddp(tmp_path) -> None:
    # 20 samples, batches of 2: 5 batches per rank, accumulate 2 -> steps after batches 2, 4 and 5.
    options = dict(max_epochs=2, limit_val_batches=0, accumulate_grad_batches=2)

    def module():
        return ClassifierModule(train_size=20, batch_size=2)

    expected = fit_state(module(), ddp_strategy(), **options)
    actual = fit_state(module(), custom_strategy(), **options)
    assert_states_close(actual, expected)
    make_trainer(custom_strategy(), callbacks=[RecordProgress(tmp_path)], **options).fit(module())
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
        trainer = make_trainer(custom_strategy(), max_epochs=3, enable_checkpointing=bool(dirpath), callbacks=callbacks)
        trainer.fit(m, ckpt_path=ckpt_path)
        return state_of(m)

    uninterrupted = run(dirpath=tmp_path)
    first_epoch = next(tmp_path.glob("epoch=0-*.ckpt"))
    checkpoint = torch.load(first_epoch, weights_only=False)
    assert checkpoint["state_dict"].keys() == module().state_dict().keys()  # a plain module's state dict
    module().load_state_dict(checkpoint["state_dict"])  # loads into one process, strict
    assert checkpoint["epoch"] == 0 and checkpoint["optimizer_states"][0]["state"]
    resumed = run(ckpt_path=first_epoch)
    # 2 more epochs of 3 steps after the restored epoch 0: the global step continues at 3
    assert [(r["current_epoch"], r["global_step"]) for r in read_progress(progress_dir)] == [(3, 9), (3, 9)]
    assert_states_close(resumed, uninterrupted)


# ----------------------------------------------------------------------------- BatchNorm2d(bias=False)


def test_batchnorm2d_without_bias_matches_one_process_on_the_global_batch() -> None:
    # Per rank 4 images a step, 2 steps; one process: the same 8 images a step.
    actual = fit_state(ConvBNModule(batch_size=4), custom_strategy(), max_steps=2, use_distributed_sampler=False)
    expected = fit_state(ConvBNModule(batch_size=8), "auto", devices=1, max_steps=2)
    assert actual.keys() == expected.keys()
    assert "net.1.bias" not in actual
    worst = max(float((actual[k].double() - expected[k].double()).abs().max()) for k in expected)
    assert worst < 1e-5, worst
    assert int(actual["net.1.num_batches_tracked"]) == 2


# ----------------------------------------------------------------------------- unused parameters


def test_unused_parameters_train_and_match_ddp_find_unused() -> None:
    initial = state_of(UnusedParamsModule())
    expected = fit_state(UnusedParamsModule(), ddp_strategy(find_unused_parameters=True), max_epochs=2)
    # ddp's own argument, accepted as a drop-in (no effect: custom_ddp synchronises unused parameters either way)
    actual = fit_state(UnusedParamsModule(), custom_strategy(find_unused_parameters=True), max_epochs=2)
    assert_states_close(actual, expected)
    assert torch.equal(actual["never_used"], initial["never_used"])  # no rank's gradient: untouched
    assert not torch.equal(actual["rank1_only"], initial["rank1_only"])  # rank 1's gradient, averaged
    assert_trained(actual, initial)
