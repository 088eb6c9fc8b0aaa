"""Checkpoints across strategies: a fit that ran under Lightning's ``ddp`` resumes under ``custom_ddp``, mid-epoch
too, and ``ddp`` reads ``custom_ddp``'s checkpoints (what users moving between the two need).

2 CPU ranks, the recording fit of :mod:`resume_cases`. A ``ddp`` checkpoint holds neither the ranks' generators
nor the epoch order custom_ddp records, and custom_ddp says what it cannot check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conformance_harness import custom_strategy, ddp_strategy
from resume_cases import assert_trained_the_rest_bitwise, fit_recorded

pytestmark = pytest.mark.distributed


@contextlib.contextmanager
def _rank_zero_messages(path: Path) -> Iterator[None]:
    """Lightning's rank-zero messages (``rank_zero_info``) written to ``path`` meanwhile: the ranks are forked, so
    they inherit the handler and write there, where pytest's capture in this process cannot see them."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = logging.FileHandler(path), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def test_a_ddp_checkpoint_resumes_mid_epoch_under_custom_ddp_as_if_uninterrupted(tmp_path: Path) -> None:
    ddp = fit_recorded(ddp_strategy(), tmp_path / "ddp")
    truth = fit_recorded(custom_strategy(), tmp_path / "custom")
    assert all(torch.equal(ddp[0]["state"][name], value) for name, value in truth[0]["state"].items())

    with _rank_zero_messages(tmp_path / "rank_zero.log"):
        resumed = fit_recorded(custom_strategy(), tmp_path / "resumed", tmp_path / "ddp" / "ckpt" / "step=4.ckpt")
    # Epoch 1 from batch 2 on (its first 2 batches were trained before step 4's checkpoint), each batch once.
    assert_trained_the_rest_bitwise(resumed, truth, (1, 2))
    said = (tmp_path / "rank_zero.log").read_text()
    assert "the checkpoint holds no random generator states (written by another strategy" in said
    assert "resuming epoch 1 at batch 2: the training loader leaves out the first 2 batches" in said
    assert "does not record how the interrupted fit ordered the epoch" in said
    assert "if it ran on 2 rank(s) with this loader and sampler" in said


def test_a_custom_ddp_checkpoint_resumes_under_ddp_as_a_ddp_checkpoint_does(tmp_path: Path) -> None:
    fit_recorded(custom_strategy(), tmp_path / "custom")
    fit_recorded(ddp_strategy(), tmp_path / "ddp")
    from_custom = fit_recorded(ddp_strategy(), tmp_path / "from_custom", tmp_path / "custom" / "ckpt" / "step=4.ckpt")
    from_ddp = fit_recorded(ddp_strategy(), tmp_path / "from_ddp", tmp_path / "ddp" / "ckpt" / "step=4.ckpt")
    for rank in range(2):  # ddp starts the epoch over either way; the checkpoints' weights are the same
        assert from_custom[rank]["seen"] == from_ddp[rank]["seen"]
        for name, value in from_ddp[rank]["state"].items():
            assert torch.equal(from_custom[rank]["state"][name], value), name
