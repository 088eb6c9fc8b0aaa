"""The fault matrix's rows (what fault, which rank, when) and what each row measures.

See :mod:`conformance.faults.matrix`, which runs them; ``tests/fault_tolerance/test_fault_matrix.py`` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "DEADLINE_S",
    "EPOCHS",
    "FAULT_BATCH",
    "FAULT_EPOCH",
    "HOLD_S",
    "ROWS",
    "ROWS_BY_NAME",
    "Result",
    "Row",
    "STALL_S",
    "STEPS_PER_EPOCH",
]

STEPS_PER_EPOCH, EPOCHS = 12, 3  # conformance.faults.fit: 384 samples / 2 ranks / batch 16; --max_epochs 3
DEADLINE_S = 90.0  # a row still running this long after its fault is killed and reported as hung
HOLD_S = 1.5  # the peer's pause at the faulted training batch, and the hold inside a checkpoint save
STALL_S = 20.0  # stall_timeout of the stall rows
FAULT_EPOCH, FAULT_BATCH = (
    1,
    3,
)  # a training fault's default: mid-epoch 1 (epoch 0's checkpoint exists, the fault's is newer)


@dataclass(frozen=True)
class Row:
    """One fault: what, which rank, when (see the module docstring)."""

    name: str
    label: str
    # SIGTERM | SIGKILL | SIGSTOP | exception(_after_forward) | rank_collective | loop | block_loader | slow_save
    fault: str
    rank: int
    phase: str  # train | val | ckpt
    desync_check: bool = False
    timeout_s: float = 30.0
    stall_timeout_s: float | None = None  # None: the strategy's default
    max_restarts: int | None = None  # run under torchrun --max-restarts=N with --ckpt_path last
    accumulate: int = 1  # accumulate_grad_batches (FAULT_BATCH 3 is then the second micro-batch of a window of 2)
    epoch: int = FAULT_EPOCH  # the training batch the fault comes in
    batch: int = FAULT_BATCH
    ckpt_every_n_epochs: int = 1  # ModelCheckpoint's; 2: no checkpoint at epoch 0's end

    @property
    def is_signal(self) -> bool:
        return self.fault.startswith("SIG")

    @property
    def final_step(self) -> int:
        """The global step an uninterrupted (or fully resumed) fit ends at."""
        return STEPS_PER_EPOCH // self.accumulate * EPOCHS


ROWS = (
    Row("sigterm_rank0_train", "SIGTERM to rank 0 during training", "SIGTERM", 0, "train"),
    Row("sigterm_rank1_train", "SIGTERM to rank 1 during training", "SIGTERM", 1, "train"),
    Row("sigterm_rank0_val", "SIGTERM to rank 0 during validation", "SIGTERM", 0, "val"),
    Row("sigterm_rank1_val", "SIGTERM to rank 1 during validation", "SIGTERM", 1, "val"),
    Row("sigterm_rank0_ckpt", "SIGTERM to rank 0 during a checkpoint save", "SIGTERM", 0, "ckpt"),
    Row("sigterm_rank1_ckpt", "SIGTERM to rank 1 during a checkpoint save", "SIGTERM", 1, "ckpt"),
    Row("sigkill_rank0_train", "SIGKILL of rank 0 during training", "SIGKILL", 0, "train"),
    Row("sigkill_rank1_train", "SIGKILL of rank 1 during training", "SIGKILL", 1, "train"),
    Row("exception_rank1_train", "exception on rank 1 only (training_step)", "exception", 1, "train"),
    Row(
        "exception_rank1_after_forward",
        "exception on rank 1 after its forward (rank 0 waits in backward)",
        "exception_after_forward",
        1,
        "train",
    ),
    Row(
        "exception_rank1_mid_window",
        "exception on rank 1 after its forward, 2nd micro-batch of accumulate_grad_batches=2",
        "exception_after_forward",
        1,
        "train",
        accumulate=2,
    ),
    Row(
        "exception_rank1_epoch_start",
        "exception on rank 1 after its forward in epoch 1's first batch, no checkpoint at epoch 0's end",
        "exception_after_forward",
        1,
        "train",
        epoch=1,
        batch=0,
        ckpt_every_n_epochs=2,
    ),
    Row(
        "rank_collective_desync",
        "collective on rank 0 only, desync_check=True",
        "rank_collective",
        0,
        "train",
        desync_check=True,
    ),
    Row(
        "rank_collective_plain",
        "collective on rank 0 only, desync_check=False (timeout 10 s)",
        "rank_collective",
        0,
        "train",
        timeout_s=10.0,
    ),
    Row(
        "sigstop_rank1_train",
        "SIGSTOP of rank 1 during training (stall_timeout 20 s)",
        "SIGSTOP",
        1,
        "train",
        stall_timeout_s=STALL_S,
    ),
    Row(
        "sigstop_rank0_train",
        "SIGSTOP of rank 0, the store's host, during training (stall_timeout 20 s)",
        "SIGSTOP",
        0,
        "train",
        stall_timeout_s=STALL_S,
    ),
    Row(
        "loop_rank1_train",
        "endless loop on rank 1 in training_step (stall_timeout 20 s)",
        "loop",
        1,
        "train",
        stall_timeout_s=STALL_S,
    ),
    Row(
        "block_loader_rank1",
        "DataLoader blocks on rank 1 (stall_timeout 20 s)",
        "block_loader",
        1,
        "train",
        stall_timeout_s=STALL_S,
    ),
    Row(
        "slow_save_rank0",
        "checkpoint save on rank 0 takes 2 x stall_timeout (20 s): must not fire",
        "slow_save",
        0,
        "ckpt",
        stall_timeout_s=STALL_S,
        timeout_s=120.0,
    ),  # a 40 s save outlasts the 30 s collective timeout
    Row(
        "sigkill_rank0_restart",
        "SIGKILL of rank 0 under torchrun --max-restarts=1",
        "SIGKILL",
        0,
        "train",
        max_restarts=1,
    ),
    Row(
        "sigkill_rank1_restart",
        "SIGKILL of rank 1 under torchrun --max-restarts=1",
        "SIGKILL",
        1,
        "train",
        max_restarts=1,
    ),
    Row(
        "exception_rank1_restart",
        "exception on rank 1 under torchrun --max-restarts=1",
        "exception",
        1,
        "train",
        max_restarts=1,
    ),
)
ROWS_BY_NAME = {row.name: row for row in ROWS}


@dataclass
class Result:
    """What a row measured (times in seconds; statuses as a shell shows them: 128 + signal if killed)."""

    row: str
    label: str
    seconds_to_all_gone: float | None
    seconds_to_exit: float | None  # to the last rank's exit event (Python's exit path begins; None if killed)
    status: dict[int, int | None]
    message: str
    checkpoint_step: int | None
    step_at_fault: int | None
    resumed_to_step: int | None = None
    resume_status: int | None = None
    steps_lost: int | None = None
    same_weights: bool | None = None  # final weights bitwise equal to an uninterrupted run's (restart rows)
    final_step: int | None = None  # where the uninterrupted fit ends (Row.final_step)
    hung: bool = False
    notes: list[str] = field(default_factory=list)
