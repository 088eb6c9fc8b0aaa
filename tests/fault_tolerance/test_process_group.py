"""The process group's start bounded apart from its collectives (``startup_timeout`` and ``timeout``), and
one process group per torchrun attempt on the agent's store.

torch, and Lightning's ``ddp`` with it, bound the rendezvous by the collective timeout: ranks that start
further apart than it fail at start. 2 CPU ranks (fork launching) of Lightning's BoringModel, rank 1
started late on purpose. A real torchrun restart that resumes: the fault matrix's restart rows (slow).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from conformance_harness import make_trainer
from conftest import run_forked
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.trainer.states import TrainerStatus
from torch.distributed.constants import default_pg_nccl_timeout
from typing_extensions import override

from strategies.custom_ddp import CustomDDPStrategy
from strategies.fault_tolerance import collective_bound, rendezvous_store, startup_bound

# Every collective's bound in these runs: short, but far above a rank's lag behind the other in a healthy
# step (a few ms; a 2-core host under 3 pytest workers can deschedule a rank for a fraction of a second).
_TIMEOUT_S = 2.5
_LATE_S = 6.0  # rank 1 starts this much later than rank 0: 2.4 x the collective bound


class _LateRank1(CustomDDPStrategy):
    """Rank 1 reaches the process group's creation ``late_s`` after rank 0 (slow imports, a late node)."""

    def __init__(self, late_s: float, **kwargs) -> None:
        super().__init__(start_method="fork", timeout=_TIMEOUT_S, **kwargs)
        self._late_s = late_s

    @override
    def setup_distributed(self) -> None:
        if self.local_rank == 1:
            time.sleep(self._late_s)
        super().setup_distributed()


class _Rank1SilentAtTrainStart(BoringModel):
    """Rank 1 sleeps at the start of training: rank 0's first collective waits for it."""

    def on_train_start(self) -> None:
        if self.global_rank == 1:
            time.sleep(_LATE_S)


def _fit(strategy: CustomDDPStrategy, module: BoringModel, tmp_path: Path) -> pl.Trainer:
    trainer = make_trainer(strategy, max_steps=3, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module)
    return trainer


@pytest.mark.distributed
def test_ranks_that_start_further_apart_than_the_collective_timeout_train(tmp_path) -> None:
    # ddp's rendezvous would end after timeout: "Timed out after 2 seconds waiting for clients. 1/2 clients joined".
    module = BoringModel()
    initial = module.layer.weight.detach().clone()
    trainer = _fit(_LateRank1(_LATE_S), module, tmp_path)
    assert trainer.state.status == TrainerStatus.FINISHED
    assert not torch.equal(module.layer.weight, initial)  # rank 0's trained weights, loaded back


@pytest.mark.distributed
def test_after_the_start_a_collective_waits_only_the_collective_timeout(tmp_path) -> None:
    start = time.monotonic()
    # gloo's, in the first gradient all-reduce; with the start's bound rank 0 would wait for rank 1 and train.
    with pytest.raises(Exception, match=r"Timed out waiting 2500ms|Application timeout caused pair closure"):
        _fit(_LateRank1(0.0, grad_transport="process_group"), _Rank1SilentAtTrainStart(), tmp_path)
    assert time.monotonic() - start < 30


@pytest.mark.distributed
def test_a_rank_later_than_the_startup_timeout_ends_the_start_naming_the_option(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match=r"1 of 2 ranks joined .* within startup_timeout=1 s") as error:
        _fit(_LateRank1(_LATE_S, startup_timeout=1), BoringModel(), tmp_path)
    assert "a longer startup_timeout" in str(error.value)
    assert time.monotonic() - start < 30


def test_the_start_waits_at_least_torchs_default_unless_told_otherwise() -> None:
    minute = timedelta(minutes=1)
    assert startup_bound(None, minute, "gloo") == timedelta(minutes=30)  # a short collective bound: 30 min
    assert startup_bound(None, timedelta(hours=2), "gloo") == timedelta(hours=2)  # never shorter than timeout
    assert startup_bound(minute, timedelta(hours=2), "gloo") == minute  # as given
    assert startup_bound(None, None, "nccl") == timedelta(minutes=30)
    nccl_default = default_pg_nccl_timeout or timedelta(minutes=30)  # None: a torch built without NCCL
    assert collective_bound(None, "nccl") == nccl_default == timedelta(minutes=10)  # torch's defaults for None
    assert collective_bound(None, "gloo") == timedelta(minutes=30)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("soon", TypeError, "startup_timeout='soon' must be a number of seconds or a timedelta"),
        (0, ValueError, "startup_timeout=0 must be > 0 seconds and finite (the start waits that long"),
        (float("inf"), ValueError, "startup_timeout=inf must be > 0 seconds and finite"),
    ],
)
def test_a_bad_startup_timeout_names_the_value_and_the_fix(value, error, message) -> None:
    with pytest.raises(error, match=r"e\.g\. startup_timeout=1800") as raised:
        CustomDDPStrategy(startup_timeout=value)
    assert message in str(raised.value)


def _attempt_worker(rank: int, port: int, restart: int, out: str) -> None:
    # What torchrun's agent gives a worker of attempt `restart` that shares its store.
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(restart))
    torch.set_num_threads(1)
    if rank == 1:
        time.sleep(1.0)  # restarted workers do not start at once: rank 0 must wait for this attempt's rank 1
    arrived = time.time()
    bound = timedelta(seconds=30)
    store = rendezvous_store("127.0.0.1", port, rank, 2, bound, bound)
    passed = time.time()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=bound)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    record = {"arrived": arrived, "passed": passed, "sum": total.item()}
    Path(out, f"attempt{restart}_rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
def test_a_restarted_attempt_on_the_agents_store_makes_its_own_group(tmp_path) -> None:
    """The agent keeps one store across restarts: attempt 1's group must not read the keys of attempt 0 (torch's
    env:// prefixes nothing): its start barrier would let rank 0 through before rank 1 came, and gloo would dial
    attempt 0's ranks, which are gone (``Gloo connectFullMesh failed ... Connection refused``)."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    for restart in (0, 1):
        ranks = [(rank, agent.port, restart, str(tmp_path)) for rank in range(2)]
        assert run_forked(_attempt_worker, ranks) == [0, 0], f"attempt {restart}"
        rank_0, rank_1 = (json.loads((tmp_path / f"attempt{restart}_rank{r}.json").read_text()) for r in range(2))
        assert rank_0["passed"] >= rank_1["arrived"], f"attempt {restart}: rank 0 went on before rank 1 joined"
        assert rank_0["sum"] == rank_1["sum"] == 3.0
