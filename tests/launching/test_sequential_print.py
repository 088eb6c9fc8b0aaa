"""Sequential rank printing: exact stdout under torchrun, ordering for world sizes 1-5."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_forked
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from collectives.launcher import run_workers
from collectives.sequential_print import main, print_order, print_sequentially

pytestmark = pytest.mark.distributed

REPO_ROOT = Path(__file__).resolve().parents[2]


def _expected(world_size: int, num_iter: int, order: str) -> str:
    block = "".join(f"Process {rank}\n" for rank in print_order(world_size, order))
    return "---\n".join([block] * num_iter)


def test_expected_text_is_what_the_issue_asks_for():
    assert _expected(3, 2, "both") == (
        "Process 0\nProcess 1\nProcess 2\nProcess 2\nProcess 1\nProcess 0\n---\n"
        "Process 0\nProcess 1\nProcess 2\nProcess 2\nProcess 1\nProcess 0\n"
    )
    assert _expected(2, 1, "ascending") == "Process 0\nProcess 1\n"


# 4 fresh interpreters (torchrun's and 3 workers'): ~19 s of CPU, the default suite's second largest
# (AMD EPYC Zen 3, 3 pytest workers). The entry point on 3 ranks, forked: the test after it.
@pytest.mark.slow
@pytest.mark.long
def test_torchrun_three_processes_stdout_is_exact():
    # One launch covers both directions: "both" prints ascending then descending.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3"]
    cmd += ["-m", "collectives.sequential_print", "--num-iter", "3", "--order", "both"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _expected(3, 3, "both")


def _main_as_a_torchrun_worker(rank: int, world_size: int, port: int, path: str) -> None:
    # torchrun's environment for this rank, and stdout on the one shared file (append: writes land in order).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with open(path, "a", encoding="utf-8") as stream:
        sys.stdout = stream
        main(["--num-iter", "3", "--order", "both"])


def test_the_entry_point_on_three_ranks_prints_in_order(tmp_path):
    """``main`` (arguments, the env:// group, the prints, leaving the group) as torchrun's workers run it."""
    out_file = tmp_path / "out.txt"
    out_file.touch()
    port = find_free_network_port()
    ranks = [(rank, 3, port, str(out_file)) for rank in range(3)]
    assert run_forked(_main_as_a_torchrun_worker, ranks) == [0, 0, 0]
    assert out_file.read_text(encoding="utf-8") == _expected(3, 3, "both")


def _print_to_shared_file(rank: int, world_size: int, path: str, num_iter: int, order: str) -> None:
    # Append mode: every rank's write lands at the current end of the one shared file, so the
    # file's content order is the order in which the ranks wrote.
    with open(path, "a", encoding="utf-8") as stream:
        print_sequentially(num_iter, order, stream=stream)


@pytest.mark.parametrize("world_size", [1, 2, 4, 5])
@pytest.mark.parametrize("order", ["ascending", "both"])
def test_order_and_separators_for_every_world_size(tmp_path, world_size, order):
    out_file = tmp_path / "out.txt"
    out_file.touch()
    args = (str(out_file), 3, order)
    run_workers(_print_to_shared_file, world_size, args=args, init_file=tmp_path / "store")
    assert out_file.read_text(encoding="utf-8") == _expected(world_size, 3, order)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="order must be one of"):
        print_order(3, "descending")
    with pytest.raises(ValueError, match="num_iter must be >= 0"):
        print_sequentially(-1)
    with pytest.raises(RuntimeError, match="torchrun"):
        print_sequentially(1)
