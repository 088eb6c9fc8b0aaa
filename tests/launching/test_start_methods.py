"""Every registered ``custom_ddp`` name and every start method fits, validates, tests and predicts
Lightning's BoringModel on 2 CPU ranks with the results of Lightning's ``ddp`` started the same way.

Each run is ``tests/launching/start_method_run.py`` in a fresh process: the popen launcher re-runs the
script per rank, and spawn/forkserver pickle the trainer with its strategy (and launcher) into
each new process. ``--check-pickle`` also pickles the strategy on every rank after setup.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from collectives.launcher import without_launch_variables
from strategies.custom_ddp import CustomDDPStrategy

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("start_method_run.py")
REPO_ROOT = SCRIPT.resolve().parents[2]

# (strategy argument, --start-method). Every run is compared with ONE run of Lightning's ddp, started with fork
# (the quickest): ddp computes the same under every start method (the module is seeded and DDP broadcasts rank 0's
# weights; test_lightning_ddp_computes_the_same_under_every_start_method, slow). Lightning's ddp with forkserver
# would be no reference: on CPU it shares the weights' memory between the ranks (a race, see strategies.launchers).
CUSTOM_RUNS = {
    "custom_ddp": ("custom_ddp", None),
    "custom_ddp_fork": ("custom_ddp_fork", None),
    "custom_ddp_spawn": ("custom_ddp_spawn", None),
    **{
        f"CustomDDPStrategy(start_method={method})": ("CustomDDPStrategy", method)
        for method in ("popen", "fork", "spawn")
    },
    "CustomDDPStrategy(start_method=forkserver)": ("CustomDDPStrategy", "forkserver"),
}
REFERENCE = ("ddp_fork", None)
# The class with popen, fork or spawn is what the registered names build (custom_ddp is the class with Lightning's
# default start method, popen: test_registered_names_are_the_class_with_a_start_method): those three runs repeat the
# registered names' and are slow-marked. forkserver runs the launcher of spawn (custom_ddp_spawn's run) with one step
# more, each worker unsharing its module's memory, which test_forkserver_workers_own_their_weights checks in one
# process: its run is slow-marked too. The fork name's run is slow as well: every stage of custom_ddp under fork is what
# most distributed tests run (tests/lightning_conformance/test_conformance_eval.py validates, tests and predicts against
# one process; the training conformance fits), and its name is the class with fork (the test named above). The spawn
# name's run (40-55 s: spawned workers import everything afresh at every stage) is slow too: what spawn adds to fork is
# the pickling of the trainer with its strategy and launcher into each new process, which
# test_spawn_pickles_the_trainer_with_its_strategy_and_launcher checks in one process. The popen run (Lightning's
# default, a script re-run; 30-50 s with its ddp reference, the default suite's longest but one) is slow as well: the
# registered name under popen fits in the quickstart test (tests/cli/test_train_cli.py) and predicts with an option in
# tests/cli/test_custom_ddp_cli.py, both re-run by the child; validate and test run the same strategy code under every
# launcher, and match ddp on BoringModel under fork (tests/lightning_conformance/: test_conformance_eval.py,
# test_conformance_fit.py).
_SLOW_RUNS = (
    "custom_ddp",
    "custom_ddp_fork",
    "custom_ddp_spawn",
    *(f"CustomDDPStrategy(start_method={method})" for method in ("popen", "fork", "spawn")),
    "CustomDDPStrategy(start_method=forkserver)",
)
# Spawned workers import everything afresh at every stage (~7 s of CPU each on 2 cores): the registered spawn
# name only fits and predicts; its validate and test, the same launcher's pickling as its fit and predict, run in
# the class-with-spawn run (and validate/test of the strategy under every other name).
_FIT_AND_PREDICT_ONLY = ("custom_ddp_spawn",)
# gloo in a spawned worker of Lightning's ddp_spawn often aborts at exit after the stage finished
# ("terminate called without an active exception", SIGABRT; 3 of 8 runs of the script on a quiet
# 2-core machine, twice in a row in one CI run): Lightning's spawn references destroy their process
# group at each stage's end (start_method_run.ReleaseGroup; 0 of 12 aborted), as custom_ddp's workers
# do by themselves (strategies.launchers), and a reference run is still retried once on that abort.
_GLOO_EXIT_ABORT = "terminate called without an active exception"


def _run(
    tmp_dir: Path, strategy: str, start_method: str | None, reference: bool = False, evaluate: bool = True
) -> dict[str, Any]:
    out = tmp_dir / f"{strategy}-{start_method}.json"
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out)]
    command += [] if evaluate else ["--no-evaluate"]
    command += ["--start-method", start_method] if start_method else []
    command += [] if reference else ["--check-pickle"]
    spawned = start_method == "spawn" or strategy.endswith("_spawn")
    command += ["--release-group"] if reference and spawned else []
    env = {**without_launch_variables(dict(os.environ)), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=tmp_dir, env=env, capture_output=True, text=True, timeout=300)
    if reference and done.returncode != 0 and _GLOO_EXIT_ABORT in done.stderr:
        done = subprocess.run(command, cwd=tmp_dir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-4000:]}"
    result = json.loads(out.read_text())
    result["weights_shared"] = json.loads(Path(f"{out}.shared.json").read_text())
    result["predict"] = {}
    for rank in range(2):
        result["predict"].update(json.loads(Path(f"{out}.predict{rank}.json").read_text()))
    return result


@pytest.fixture(scope="module")
def ddp_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Lightning's ddp, started with fork: the results every custom_ddp run must give."""
    return _run(tmp_path_factory.mktemp("ddp"), *REFERENCE, reference=True)


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=1e-6, msg=what)


def _assert_same_results(custom: dict[str, Any], ddp: dict[str, Any], what: str) -> None:
    for left, right in zip(custom["weights"], ddp["weights"], strict=True):
        _assert_close(left, right, f"{what}: fitted weights")
    for stage in ("validate", "test") if "validate" in custom else ():
        assert custom[stage][0].keys() == ddp[stage][0].keys(), (stage, custom[stage], ddp[stage])
        for key, value in ddp[stage][0].items():
            _assert_close(custom[stage][0][key], value, f"{what}: {stage} {key}")
    assert sorted(custom["predict"], key=int) == sorted(ddp["predict"], key=int) == [str(i) for i in range(64)]
    for index, value in ddp["predict"].items():
        _assert_close(custom["predict"][index], value, f"{what}: prediction of sample {index}")


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name in _SLOW_RUNS else []) for name in CUSTOM_RUNS]
)
def test_each_name_and_start_method_runs_every_stage_as_ddp(name: str, tmp_path: Path, ddp_result: dict) -> None:
    custom = _run(tmp_path, *CUSTOM_RUNS[name], evaluate=name not in _FIT_AND_PREDICT_ONLY)
    # Each rank owns its weights: with forkserver the ranks' parameters were one shared storage (every
    # rank's optimizer step also moved the others'; a full run fitted 0.029 from the truth).
    assert custom["weights_shared"] is False, f"{name}: rank 1's change to its weights reached rank 0"
    assert custom["strategy"] == "CustomDDPStrategy" and ddp_result["strategy"] == "DDPStrategy"
    _assert_same_results(custom, ddp_result, f"{name} vs {REFERENCE[0]}")


@pytest.mark.slow
@pytest.mark.parametrize("start", [("ddp", None), ("ddp_spawn", None), ("DDPStrategy", "popen")], ids=str)
def test_lightning_ddp_computes_the_same_under_every_start_method(start: tuple, tmp_path: Path, ddp_result: dict):
    """Why one reference run serves every start method above."""
    _assert_same_results(_run(tmp_path, *start, reference=True), ddp_result, f"{start} vs {REFERENCE[0]}")


class _Launched(Exception):
    """Raised by the stand-in for ``torch.multiprocessing.start_processes`` once it has pickled what spawn sends."""


def test_spawn_pickles_the_trainer_with_its_strategy_and_launcher(monkeypatch, tmp_path: Path) -> None:
    """What ``custom_ddp_spawn`` sends each new process at launch, pickled as spawn pickles it (in this process: a
    closure or a lock on the strategy fails here; the end-to-end spawn run above is slow)."""
    from multiprocessing.reduction import ForkingPickler  # with torch.multiprocessing's tensor reductions

    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    sent: list[bytes] = []

    def start_processes(function: Any, args: tuple, nprocs: int, start_method: str, **kwargs: Any) -> None:
        assert (nprocs, start_method) == (2, "spawn")
        # args: trainer, stage function, its arguments and kwargs, multiprocessing's own result queue (which pickles
        # only while a process starts), Lightning's snapshot of global state
        sent.append(bytes(ForkingPickler.dumps((function, args[:4] + args[5:]))))
        raise _Launched

    monkeypatch.setattr("torch.multiprocessing.start_processes", start_processes)
    options = dict(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer = Trainer(strategy="custom_ddp_spawn", accelerator="cpu", devices=2, default_root_dir=tmp_path, **options)
    with pytest.raises(_Launched):
        trainer.fit(BoringModel())
    function, (received, *_) = pickle.loads(sent[0])
    assert isinstance(received.strategy, CustomDDPStrategy) and received.strategy.launcher is not None
    assert function.__self__._start_method == "spawn"  # the launcher's _wrapping_function, bound


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_forkserver_workers_own_their_weights(start_method: str, monkeypatch) -> None:
    """A module received through torch.multiprocessing (its parameters in shared memory, one storage for every
    rank) gets memory of its own in a forkserver or spawn worker before the stage runs; fork shares nothing."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from strategies.launchers import OneStageMultiProcessingLauncher

    monkeypatch.setenv("LOCAL_RANK", "0")  # the worker sets it
    strategy = SimpleNamespace(accelerator=CPUAccelerator(), num_processes=2)
    launcher = OneStageMultiProcessingLauncher(strategy, start_method=start_method)
    received = torch.nn.Linear(2, 2).share_memory()
    seen = []
    launcher._wrapping_function(1, None, lambda module: seen.append(module.weight.is_shared()), (received,), {}, None)
    assert seen == [start_method == "fork"]


def test_a_fork_fit_leaves_no_folder_in_the_temporary_directory(monkeypatch, tmp_path: Path) -> None:
    """Rank 0's last weights come back to the launching process through a file in a new temporary folder: Lightning's
    ddp_fork removes the file and leaves the folder (one per fit), custom_ddp's launcher removes both."""
    from conformance_harness import make_trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temporary))  # the forked ranks inherit it
    left = {}
    for name in ("ddp_fork", "custom_ddp_fork"):
        before = set(temporary.iterdir())
        make_trainer(name, max_steps=1, limit_val_batches=0, default_root_dir=tmp_path).fit(BoringModel())
        left[name] = [list(folder.iterdir()) for folder in set(temporary.iterdir()) - before]
    assert left == {"ddp_fork": [[]], "custom_ddp_fork": []}


def test_registered_names_are_the_class_with_a_start_method() -> None:
    for name, start_method in (("custom_ddp", None), ("custom_ddp_fork", "fork"), ("custom_ddp_spawn", "spawn")):
        entry = StrategyRegistry[name]
        assert entry["strategy"] is CustomDDPStrategy
        assert entry["init_params"] == ({"start_method": start_method} if start_method else {})


def test_a_failed_child_ends_the_other_children_at_once_and_rank_0_after_a_grace(monkeypatch) -> None:
    """The popen launcher's observer: rank 0 (here a stand-in process) may finish writing its last
    checkpoint before it is killed; Lightning's own observer SIGKILLs it at once."""
    import signal
    import threading
    import time

    from strategies import launchers

    monkeypatch.setattr(launchers, "RANK0_GRACE_S", 1.0)
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    rank0, other = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait()
    observer = launchers._ObserverSparingRank0(main_pid=rank0.pid, child_processes=[failed, other])
    started = time.monotonic()
    poll = threading.Thread(target=observer._run)  # one poll of Lightning's loop: a child failed
    poll.start()
    other.wait(timeout=5)
    assert other.returncode == -signal.SIGKILL
    time.sleep(0.3)
    assert rank0.poll() is None  # spared while it may still be writing
    rank0.wait(timeout=5)
    poll.join()
    assert rank0.returncode == -signal.SIGKILL and time.monotonic() - started >= 1.0
