"""What keeping every rank's random generators for the last checkpoint costs per optimizer step.

With ``exact_resume`` each rank keeps its generators at every point where an accumulation window may
begin, and threads write them to the job's TCP store and, under Lightning's launchers, to the mirror
rank 1 hosts (``strategies/window_generators.py``). Two CPU ranks (fork + gloo, 1 thread each) run
custom_ddp's training step by hand on the quickstart's template net (batch 128 per rank, 16 with ``--quick``,
SyncBatchNorm, the bucketed gradient all-reduce, SGD), with a keep at each step's start (where the
watchdog keeps them: after the previous step's batch) and without, in interleaved rounds: ``off``
(no keeping), ``store`` (the job's store only: torchrun's agent store) and ``store + mirror`` (the
job's store and rank 1's mirror: Lightning's launchers). The job's store is a TCP store server in
the benchmark's own process, as rank 0's would be. A sample is the slowest rank's barrier-aligned
step time; the cost is its difference to ``off``, and includes the writing threads' competition with
the step for the interpreter and the core. Also timed on its own, in this process: reading the generators
(``rng_state``, on the main thread) and encoding them (``encode_rng_state``, on a writing thread)::

    python -m benchmarks.costs.generator_keeping          # about 2 minutes on 2 cores
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.benchmark
from torch import nn

from benchmarks import harness, report
from collectives.launcher import run_workers
from lit_cifar.nets import TemplateNet
from measure.stats import difference_ci, in_runs, ratio_ci
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.resume.rng_state import encode_rng_state, rng_state
from strategies.fault_tolerance import WindowGenerators, connect_store

MODES = ("off", "store", "store + mirror")
BATCH, QUICK_BATCH = 128, 16  # --quick checks that the entry point runs: a small batch, one warm-up step
TITLE = "Cost of keeping every rank's random generators per optimizer step (exact_resume)"


def _keepers(rank: int, world_size: int, port: int) -> dict[str, WindowGenerators | None]:
    """Per mode, this rank's keeper (each on its own store connection and keys)."""
    job_store = ("127.0.0.1", port)
    return {
        "off": None,
        "store": WindowGenerators(connect_store(*job_store, "store/"), rank, world_size),
        "store + mirror": WindowGenerators(
            connect_store(*job_store, "mirror/"), rank, world_size, mirror_toward=job_store
        ),
    }


def _steps_worker(rank: int, world_size: int, port: int, cfg: dict[str, int]) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = SyncedDataParallel(SyncBatchNorm.convert(TemplateNet(num_classes=100)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(cfg["batch"], 3, 32, 32), torch.randint(0, 100, (cfg["batch"],))
    keepers = _keepers(rank, world_size, port)
    dist.barrier()  # rank 1's mirror is published before anyone writes to it

    def step(keeper: WindowGenerators | None) -> Callable[[], None]:
        def run() -> None:
            if keeper is not None:
                keeper.keep(0)
            nn.functional.cross_entropy(model(x), y).backward()
            model.finish()
            optimizer.step()
            optimizer.zero_grad()

        return run

    times = harness.timed_rounds({mode: step(keeper) for mode, keeper in keepers.items()}, cfg)
    for keeper in keepers.values():
        if keeper is not None:
            keeper.close()
    return times


def _measure(cfg: dict[str, int]) -> dict[str, list[float]]:
    """Per mode, the slowest rank's step times (``cfg``: warmup, rounds, iters a round, batch)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return harness.slowest_ranks(run_workers(_steps_worker, 2, args=(server.port, cfg), timeout_s=600))


def _time_calls(call: Callable[[], Any], calls: int) -> list[float]:
    timer = torch.utils.benchmark.Timer("call()", globals={"call": call}, num_threads=1)
    return [timer.timeit(50).mean for _ in range(calls)]  # a sample: the mean of 50 calls


def _sections(cfg: dict[str, int]) -> dict[str, Any]:
    """The step per mode (its rounds resampled whole), its cost and ratio against ``off``; reading and
    encoding the generators, timed on their own."""
    times = {mode: in_runs(samples, cfg["iters"]) for mode, samples in _measure(cfg).items()}
    state = rng_state()
    calls = {
        "rng_state": _time_calls(rng_state, 40),
        "encode_rng_state": _time_calls(lambda: encode_rng_state(state), 40),
    }
    off = times["off"]
    return {
        "step_s": harness.medians(times),
        "cost_s": {mode: asdict(difference_ci(times[mode], off)) for mode in MODES[1:]},
        "ratio": {mode: asdict(ratio_ci(times[mode], off)) for mode in MODES[1:]},
        "call_s": harness.medians(calls),
    }


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode: the step against ``off`` (ratio) and the added time per step."""
    return [
        row
        for mode in MODES[1:]
        for row in (
            report.headline_row(f"template net, 2 ranks: step keeping them ({mode}) / off", record["ratio"][mode], "x"),
            report.headline_row(f"template net, 2 ranks: added time per step ({mode})", record["cost_s"][mode], "s"),
        )
    ] + [report.headline_row(f"{what} (one call)", record["call_s"][what], "s") for what in record["call_s"]]


def _publish(record: dict[str, Any], out: Path) -> None:  # not write(): the record keeps no samples to re-derive
    record["headline"] = headline(record)
    steps = [[mode, report.fmt_value(record["step_s"][mode], "s")] for mode in MODES]
    report.publish(out, record, TITLE, ["## Step time", "", *report.table("mode | step (median [95 % CI])", steps)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, rounds, steps = harness.parse_step_rounds(
        "generator_keeping", __doc__, argv, rounds=20, steps=10, quick=(2, 2)
    )
    batch, warmup = (QUICK_BATCH, 1) if args.quick else (BATCH, 3)
    config = {"rounds": rounds, "steps": steps, "batch": batch, "threads": 1}
    measure = lambda: _sections({"warmup": warmup, "rounds": rounds, "iters": steps, "batch": batch})  # noqa: E731
    return harness.run_benchmark(
        "costs.generator_keeping", config, argv, _publish, measure, args.out, args.max_wait_s, timed=False
    )


if __name__ == "__main__":
    main()
