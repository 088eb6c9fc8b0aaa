"""The desync check's option, its error detection and the attribution of a rank's own collective.

The end-to-end case (a collective on rank 0 only, caught within milliseconds, both sides named by
rank 0) is a row of the fault matrix (``test_fault_matrix.py``); the cost table of docs/benchmarks.md
must come from the committed ``benchmarks/results/desync_cost`` record (``tests/measurement/test_readme_results.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collectives.launcher import run_workers
from strategies.custom_ddp import CustomDDPStrategy
from strategies.fault_tolerance.desync import (
    _STRATEGIES_DIR,
    _torch_view,
    enable_desync_check,
    is_desync_error,
    own_side,
    report_desync,
)


def _user_collective() -> None:
    # Raises from inside all_reduce whether or not an earlier test left a process group behind.
    dist.all_reduce(torch.zeros(3), op="not an op")


def test_own_side_names_the_collective_its_tensor_and_the_user_line() -> None:
    with pytest.raises((RuntimeError, TypeError, ValueError)) as caught:
        _user_collective()
    side = own_side(caught.value.__traceback__, rank=1)
    assert side.startswith("rank 1: all_reduce(float32[3]) from user code tests/fault_tolerance/test_desync.py:")
    assert side.endswith("in _user_collective")


def test_own_side_passes_over_every_strategy_frame_to_the_user_line() -> None:
    # A strategy method calling another (scatter evaluation's reduce from the uneven-data reduce): the innermost
    # names the method, and the line reported as the user's is the first frame outside strategies/.
    namespace: dict = {"dist": dist}
    inner, outer = f"{_STRATEGIES_DIR}evaluation/inner.py", f"{_STRATEGIES_DIR}training/outer.py"
    exec(compile("def reduce(t):\n    dist.all_reduce(t, op='not an op')\n", inner, "exec"), namespace)
    exec(compile("def forward(t):\n    reduce(t)\n", outer, "exec"), namespace)
    with pytest.raises((RuntimeError, TypeError, ValueError)) as caught:
        namespace["forward"](torch.zeros(3))
    side = own_side(caught.value.__traceback__, rank=0)
    user_line = "from user code tests/fault_tolerance/test_desync.py:"
    assert f"from strategy.reduce (evaluation/inner.py:2) {user_line}" in side, side
    assert side.endswith("in test_own_side_passes_over_every_strategy_frame_to_the_user_line"), side


def test_only_torchs_mismatch_report_counts_as_a_desync() -> None:
    mismatch = RuntimeError("Detected mismatch between collectives on ranks. Rank 0 is running collective: ...")
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = mismatch
    assert is_desync_error(mismatch) and is_desync_error(wrapped)
    assert not is_desync_error(RuntimeError("Connection closed by peer"))
    assert report_desync(RuntimeError("other"), 0, 2, "127.0.0.1", 1) is None


# torch 2.14's texts, as two ranks of an LBFGS line search (one closure more on rank 1) raised them.
_SEEN_BY_RANK_1 = (
    "Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint("
    "SequenceNumber=26, OpType=ALLREDUCE, TensorShape=[89], TensorDtypes=Double, TensorDeviceTypes="
    "TensorOptions(dtype=float (default), device=cpu)), but Rank 0 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=26, OpType=BROADCAST, TensorShape=[1], TensorDtypes=Long, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))."
)
_SEEN_BY_RANK_0 = "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 60000 ms"


@pytest.mark.parametrize(
    ("text", "added"),
    [
        (_SEEN_BY_RANK_1, "; torch saw rank 0 issue broadcast(int64[1])"),
        (
            "Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
            "SequenceNumber=31, OpType=ALLREDUCE, TensorShape=[16], TensorDtypes=Float), but Rank 1 is running "
            "collective: "
            "CollectiveFingerPrint(SequenceNumber=31OpType=BARRIER).",
            "; torch saw rank 1 issue barrier()",
        ),
        # The fault matrix's rank-0-only barrier: torch names its check's own gather (sequence 0), not rank 1's
        # all_reduce.
        (
            "Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
            "SequenceNumber=92OpType=BARRIER), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0"
            "OpType=GATHER).",
            "",
        ),
        (_SEEN_BY_RANK_0, " (where it found a peer gone; the mismatch is in the peer's line)"),
        ("Connection closed by peer", ""),
    ],
)
def test_a_ranks_line_adds_what_torch_saw_of_the_peer(text: str, added: str) -> None:
    wrapped = RuntimeError("backward failed")
    wrapped.__cause__ = RuntimeError(text)  # the text may come chained
    assert _torch_view(wrapped) == added


def test_option_must_be_a_bool() -> None:
    assert CustomDDPStrategy(desync_check=True).options.desync_check is True
    with pytest.raises(ValueError, match="desync_check='yes' must be a bool"):
        CustomDDPStrategy(desync_check="yes")


def _enable_after_init(rank: int, world_size: int) -> str:
    try:
        enable_desync_check()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_enabling_after_the_process_group_exists_is_refused(tmp_path) -> None:
    messages = run_workers(_enable_after_init, 1, init_file=tmp_path / "store")
    assert "must be set before the process group exists" in messages[0]
    assert dist.get_debug_level() == dist.DebugLevel.OFF
