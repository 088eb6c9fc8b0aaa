"""The fault matrix on a real 2-rank fit (popen launcher, real signals from outside, 30 s timeouts).

The default run keeps two rows (about 1 minute): a SIGSTOP'd rank 0, the store's host (a stall,
``stall_timeout`` 10 s here, 20 s in the matrix), and an exception on rank 1 under ``torchrun
--max-restarts=1``. Every row, with a resume from each checkpoint and the restart rows' final
weights compared with an uninterrupted run, is ``slow``: ``pytest -m slow tests/fault_tolerance/test_fault_matrix.py``
(about 9 minutes on 2 cores).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.faults import report
from conformance.faults.matrix import DEFAULT_OUT, ROWS, ROWS_BY_NAME, Result, Row, run_row
from strategies.fault_tolerance.stall_watch import STALL_EXIT_STATUS

STALL_TEST_S = 10.0  # stall_timeout of the stall rows run by default (the record: faults.rows.STALL_S)
WITHIN_S = 30.0  # issue 17: every row ends within 30 s of its fault; issue 23: a stall within 30 s of its start
STALL_SIGNS = {
    "SIGSTOP": "no answer: process stopped or frozen",
    "loop": "in training_step",
    "block_loader": "in __getitem__",
}


def _check_stall(row: Row, result: Result) -> None:
    if row.fault == "slow_save":  # a save of 2 x stall_timeout: no stall, the fit goes on to the end
        assert result.status == {0: 0, 1: 0} and "stall" not in result.message, result
        assert result.resumed_to_step == row.final_step, result
        return
    if row.rank == 0:
        # The store's host under Lightning's launcher: rank 1's store calls go unanswered (bounded by
        # strategies.fault_tolerance.job_store; they blocked for good before), it kills the stopped rank 0 and ends.
        assert result.status[0] == 128 + 9, result  # SIGKILL: what a scheduler sees of the popen job
        assert result.message.startswith("custom_ddp stall: rank 1: the job's store has not answered"), result
        assert "rank 0 process state: T, killed" in result.message, result.message
        # Rank 1 wrote the last completed step before killing rank 0 (its main thread waited in a collective).
        assert result.checkpoint_step == result.step_at_fault and result.steps_lost == 0, result
        assert "written by rank 1, rank 0 being lost" in result.message, result.message
        assert row.stall_timeout_s <= result.seconds_to_all_gone < WITHIN_S, result
        return
    assert result.status[0] == STALL_EXIT_STATUS, result
    assert result.message.startswith("custom_ddp stall: rank(s) 1 stalled") and "STALLED rank 1" in result.message
    assert STALL_SIGNS[row.fault] in result.message, result.message
    assert row.stall_timeout_s <= result.seconds_to_all_gone < WITHIN_S, result
    # Rank 0 waited in a collective outside any optimizer update: it wrote the last completed step.
    assert result.checkpoint_step in (result.step_at_fault, result.step_at_fault + 1), result
    assert "checkpoint of the last completed optimizer step" in result.message, result.message


def _check_restart(row: Row, result: Result, resumed: bool) -> None:
    assert (result.resume_status, result.resumed_to_step) == (0, row.final_step), result
    # The survivor (rank 0, or rank 1 when rank 0 is lost) waited outside an optimizer update and wrote the last
    # completed step with every rank's generators (torchrun's agent store outlives the lost rank): nothing re-done.
    assert result.steps_lost == 0, result
    writer = "rank 0" if row.rank == 1 else "rank 1, rank 0 being lost"
    assert (
        f"written by {writer}" in result.message and "random generators: every rank's at that step" in result.message
    ), result.message
    if row.fault == "exception":
        assert "custom_ddp: rank 1 ended first: RuntimeError: injected fault" in result.message, result.message
    if resumed:  # a mid-epoch resume (exact_resume): the rest of the epoch, each batch once
        assert result.same_weights is True, result


def _store_lost_with_rank0(row: Row) -> bool:
    """Rank 0, the job store's host under Lightning's launcher, is the rank lost: rank 1 writes the last
    checkpoint with every rank's generators from the mirror it hosts (strategies.fault_tolerance.window_generators)."""
    return row.rank == 0 and row.fault in ("SIGKILL", "SIGSTOP") and row.max_restarts is None


def _check_sigterm(row: Row, result: Result, resumed: bool) -> None:
    assert result.status == {0: 143, 1: 143}, result
    assert f"SIGTERM on rank {row.rank}: all 2 ranks stopped" in result.message, result.message
    assert result.checkpoint_step is not None and result.step_at_fault is not None, result
    # Training: the batch in flight is the last one. Validation / checkpoint save (after the
    # epoch's last batch): the next optimizer step is the last one.
    stop = 1 if row.phase == "train" else 2
    assert result.checkpoint_step == result.step_at_fault + stop, result
    if resumed:
        assert (result.resume_status, result.resumed_to_step) == (0, row.final_step), result


def _check(row: Row, result: Result, resumed: bool) -> None:
    assert not result.hung, result
    if _store_lost_with_rank0(row):
        assert "random generators: every rank's at that step" in result.message, result.message
    # Every resumed fit, mid-epoch ones included, ends with the uninterrupted fit's weights.
    assert not resumed or result.same_weights is not False, result
    if row.stall_timeout_s is not None:
        return _check_stall(row, result)
    if row.max_restarts is not None:
        return _check_restart(row, result, resumed)
    assert result.seconds_to_all_gone is not None and result.seconds_to_all_gone < WITHIN_S, result
    if row.fault == "SIGTERM":
        return _check_sigterm(row, result, resumed)
    if row.fault in ("SIGKILL", "exception", "exception_after_forward"):
        # The survivor waited in a collective before the optimizer update: it wrote the last completed step
        # (rank 0, or rank 1 when rank 0 is the rank lost).
        writer = "rank 0" if row.rank == 1 else "rank 1, rank 0 being lost"
        assert result.checkpoint_step == result.step_at_fault, result
        assert result.steps_lost == 0, result
        assert (
            f"checkpoint of the last completed optimizer step {result.step_at_fault} written by {writer}"
            in result.message
        ), result.message
    elif row.fault == "rank_collective" and not row.desync_check:
        assert result.checkpoint_step is not None, result  # rank 0 timed out before any update: consistent
    else:
        assert result.checkpoint_step is None, result  # a desync error: the ranks' states may differ
    assert result.status[0] not in (0, None), result
    if row.fault.startswith("exception"):
        assert "injected fault: rank 1 raised" in result.message, result.message
    if row.fault == "rank_collective" and row.desync_check:
        message = result.message
        assert "desync check" in message and "rank 0: barrier() from strategy.reduce" in message, message
        assert "faults/fit.py" in message and "rank 1: all_reduce(float32[16]) from SyncBN backward" in message
        assert result.seconds_to_exit is not None and result.seconds_to_exit < 5.0, result
    if row.fault == "rank_collective" and not row.desync_check:
        assert result.seconds_to_exit is not None and result.seconds_to_exit >= row.timeout_s - 1, result


# Rows whose mechanism a faster 2-rank fork test proves already run with the slow ones: a SIGTERM to rank 1 mid-step
# (test_preemption.py::test_sigterm_on_rank_1_stops_both_ranks_at_that_step_and_resumes_exactly) and a
# collective one rank issues alone under desync_check
# (test_worker_exception.py::test_a_step_one_fork_worker_repeats_is_a_desync_report_of_both_sides_in_seconds),
# and a rank looping in training_step: its parts are proven in one process (test_watchdog.py: a silent main
# thread outside a collective stalls, its peer waiting in one does not; the verdict is agreed once and the reporter
# names the stalled rank), and the end-to-end stall path (store, verdict, exit 75 on every rank) by the SIGSTOP row.
# The torchrun restart: 5 fresh interpreters, 47 s of CPU, a tenth of the default suite's (AMD EPYC Zen 3). What
# broke restarts once, a restarted attempt's process group on the agent's store, runs on 2 forked ranks
# (test_process_group.py::test_a_restarted_attempt_on_the_agents_store_makes_its_own_group), --ckpt_path=last in one
# process (test_last_checkpoint.py); the restart itself and its report of the steps re-done run with the slow ones.
_SHORT_SLOW = ("sigterm_rank1_train", "rank_collective_desync", "loop_rank1_train", "exception_rank1_restart")


@pytest.mark.long
@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in _SHORT_SLOW else [])
        for name in (
            "sigterm_rank1_train",
            "rank_collective_desync",
            "loop_rank1_train",
            "sigstop_rank0_train",
            "exception_rank1_restart",
        )
    ],
)
def test_fault_matrix_short(tmp_path: Path, name: str) -> None:
    row = ROWS_BY_NAME[name]
    if row.stall_timeout_s is not None and row.fault != "slow_save":
        # Half the matrix's 20 s: the same detection (a step of this fit takes well under a second), 10 s sooner.
        row = replace(row, stall_timeout_s=STALL_TEST_S)
    _check(row, run_row(row, tmp_path / name, resume=False), resumed=False)


@pytest.fixture(scope="module")
def rows_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the resumed rows: the uninterrupted fit each is compared with runs once per accumulation
    setting (conformance.faults.matrix.same_as_uninterrupted), as in the full matrix."""
    return tmp_path_factory.mktemp("fault_rows")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    [
        # Every row here is slow (three 2-rank fits each, 60 s for mid_window, which kept the default suite over
        # 5 minutes); their parts run by default, faster: a fork worker whose peer is lost writes the last
        # checkpoint and names the peer (test_worker_exception.py), that checkpoint holds the buffers and
        # batch counters of the accumulation window's first micro-batch (test_last_checkpoint.py,
        # test_the_last_checkpoint_holds_the_state_of_the_last_optimizer_step), rank 1's generators come from the
        # job's store (test_window_generators.py), the generators kept before an epoch's loader draws
        # (tests/resume/test_resume_rng.py, test_the_generators_kept_at_training_start_are_those_a_checkpoint_...) and a
        # bitwise mid-epoch resume (test_a_resumed_fit_draws_the_interrupted_fits_random_numbers_...).
        pytest.param("exception_rank1_after_forward", marks=pytest.mark.slow),
        pytest.param("exception_rank1_mid_window", marks=pytest.mark.slow),
        pytest.param("exception_rank1_epoch_start", marks=pytest.mark.slow),
    ],
)
def test_a_failure_inside_a_step_leaves_a_checkpoint_that_resumes_bitwise(rows_folder: Path, name: str) -> None:
    """Rank 1 raises after its forward; rank 0, waiting in backward with its BatchNorm statistics moved by
    the batch, writes the last completed step with the buffers of the step's first batch
    (strategies.fault_tolerance.last_checkpoint) and every rank's random generators at that batch, rank 1's from the
    job's store (strategies.fault_tolerance.window_generators); the resume trains the rest of the epoch once
    (exact_resume), draws the same dropout masks and ends with the uninterrupted weights. With
    accumulate_grad_batches=2 the fault comes in a window's second micro-batch: the checkpoint goes back
    to the window's first, whose gradient only the ranks held. In an epoch's first batch the generators
    are those at the previous epoch's end, before the epoch's loader iterator drew its seed (the resume
    makes that draw again)."""
    row = ROWS_BY_NAME[name]
    result = run_row(row, rows_folder / row.name, resume=True)
    _check(row, result, resumed=True)
    assert "random generators: every rank's at that step" in result.message, result.message
    assert result.same_weights is True and result.resumed_to_step == row.final_step, result


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_fault_matrix_row(tmp_path: Path, row: Row) -> None:
    _check(row, run_row(row, tmp_path / row.name, resume=True), resumed=True)


def test_readme_fault_table_is_generated_from_the_committed_results() -> None:
    record = json.loads((DEFAULT_OUT / "results.json").read_text())
    current, fresh = report.update_readme(record)
    assert current == fresh, (
        "docs/stopping-and-resuming.md's fault table is stale: run python -m conformance.faults.report --write "
        "(or python -m conformance.faults.matrix)"
    )
