"""Where SyncBatchNorm's cost goes in a 2-rank CPU training step: its kernel, its exchange, or the lockstep.

    python -m benchmarks.batchnorm.syncbn_lockstep                               # ResNet-18: ~3 min on 2 Zen 3 cores
    python -m benchmarks.batchnorm.syncbn_lockstep --net template                # the template net: ~30 seconds
    python -m benchmarks.batchnorm.syncbn_lockstep --quick --out /tmp/lockstep   # smoke run

Issue 48: at accumulate 4 ``ddp`` communicates on one micro-batch of four, while SyncBatchNorm exchanges
statistics twice per layer on every micro-batch (ResNet-18: 20 layers, 40 exchanges), and paired fits put
``custom_ddp`` (SyncBN) / ``ddp`` tuned at 1.15-1.24 there. Each of 2 ranks (1 intra-op thread, one host)
builds the net four times: with torch's BatchNorm (``local``); with SyncBatchNorm on one-rank groups
(``kernel``: the hand-written kernel, no exchange); with SyncBatchNorm through shared memory (``shared``,
``custom_ddp``'s default on one CPU host) and through gloo (``gloo``). A call is one micro-batch
(batch 8 per rank, forward+backward under ``no_sync()``, what an accumulating micro-batch is), started
right after a barrier; the methods interleave, round after round, the order alternating. Kept per call and
rank: seconds, and the seconds spent in the shared-memory barriers (this process's
``FutexBarrier.wait`` wrapped with a clock). Derived: the slowest rank's medians and their ratios to
``local`` (CIs drawing whole rounds); for ``shared``, each rank's time waiting at the barriers and its
compute (time minus waiting) against ``kernel``: what running in lockstep costs besides the waiting.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import interleave, parse, parser, round_estimates, run_benchmark, slowest_ranks
from benchmarks.report import fmt_value, headline_row, publish, table
from collectives.launcher import run_workers
from lit_cifar.nets import build_net
from measure.timing import aligned_seconds
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.host import shm_barrier
from parallel.host.host_exchange import open_shared_memory_exchange

TITLE = "SyncBatchNorm in a 2-rank CPU micro-batch: kernel, exchange, lockstep"
METHODS = ("local", "kernel", "shared", "gloo")
FULL = {"rounds": 60, "iters": 1, "warmup": 2}
QUICK = {"rounds": 2, "iters": 1, "warmup": 1}


class _BarrierClock:
    """Seconds and calls of this process's shared-memory barrier waits since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._wait = 0.0, 0, shm_barrier.FutexBarrier.wait

    def install(self) -> None:
        clock = self

        def timed_wait(barrier: shm_barrier.FutexBarrier) -> None:
            start = time.perf_counter()
            clock._wait(barrier)
            clock.seconds, clock.calls = clock.seconds + time.perf_counter() - start, clock.calls + 1

        shm_barrier.FutexBarrier.wait = timed_wait  # this (forked) worker only

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _model(method: str, net: str, world_size: int, solo: dist.ProcessGroup) -> SyncedDataParallel:
    torch.manual_seed(0)
    module = build_net(net)
    if method != "local":  # kernel: one-rank groups, so the kernel runs without an exchange
        module = SyncBatchNorm.convert(module, solo if method == "kernel" else None)
    model = SyncedDataParallel(module)
    if method == "shared":
        members, capacity = list(range(world_size)), SyncBatchNorm.largest_statistics(model)
        SyncBatchNorm.use_exchange(model, open_shared_memory_exchange(model.shared_memory, members, capacity), None)
    return model


def _worker(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    solos = [dist.new_group([k]) for k in range(world_size)]  # every rank makes every group
    models = {method: _model(method, cfg["net"], world_size, solos[rank]) for method in METHODS}
    x, y = torch.randn(cfg["batch"], 3, 32, 32), torch.randint(0, 100, (cfg["batch"],))
    clock = _BarrierClock()
    clock.install()

    def call(method: str) -> tuple[float, float, int]:
        def micro_batch() -> None:
            with models[method].no_sync():
                F.cross_entropy(models[method](x), y).backward()

        clock.reset()
        seconds = aligned_seconds(micro_batch)
        return seconds, clock.seconds, clock.calls

    for method in [m for _ in range(cfg["warmup"]) for m in METHODS]:
        call(method)
    rounds = interleave(list(METHODS), cfg["rounds"], lambda m, _: [call(m) for _ in range(cfg["iters"])])
    calls = {method: [c for block in blocks for c in block] for method, blocks in rounds.items()}
    return {
        "samples": {m: [c[0] for c in calls[m]] for m in METHODS},
        "wait_s": [c[1] for c in calls["shared"]],
        "exchanges": calls["shared"][0][2],
        "threads": torch.get_num_threads(),
    }


def estimates(record: dict[str, Any]) -> dict[str, Any]:
    """The slowest rank's medians and ratios to local; per rank, shared's waiting and compute against kernel."""
    cfg, ranks = record["config"], record["ranks"]
    slowest = slowest_ranks([r["samples"] for r in ranks])
    pairs = [(m, "local") for m in METHODS[1:]] + [("shared", "kernel"), ("gloo", "shared")]
    per_rank: dict[str, list[float]] = {}
    for k, r in enumerate(ranks):
        per_rank[f"rank {k} waiting"] = r["wait_s"]
        per_rank[f"rank {k} computing"] = [s - w for s, w in zip(r["samples"]["shared"], r["wait_s"], strict=True)]
        per_rank[f"rank {k} kernel"] = r["samples"]["kernel"]
    compute_pairs = [(f"rank {k} computing", f"rank {k} kernel") for k in range(len(ranks))]
    return {
        "slowest": round_estimates(slowest, cfg["iters"], pairs),
        "ranks": round_estimates(per_rank, cfg["iters"], compute_pairs),
    }


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    slowest, ranks = record["estimates"]["slowest"], record["estimates"]["ranks"]
    what = f"{record['config']['net']}, batch {record['config']['batch']} per rank, micro-batch of the slowest rank"
    rows = [headline_row(f"{m} / local BN: {what}", slowest["ratios"][f"{m}/local"], "x") for m in METHODS[1:]]
    for k in range(len(record["ranks"])):
        waiting = f"rank {k}: shared, time in the {record['ranks'][k]['exchanges']} barriers of a micro-batch"
        rows.append(headline_row(waiting, ranks["median_s"][f"rank {k} waiting"], "s"))
        computing = f"rank {k}: shared, compute (time - barriers) / kernel alone: lockstep's cost beyond waiting"
        rows.append(headline_row(computing, ranks["ratios"][f"rank {k} computing/rank {k} kernel"], "x"))
    return rows


def write(record: dict[str, Any], out: Path) -> None:
    """results.json and results.md from the record alone (rederive calls it too)."""
    record["estimates"] = estimates(record)
    record["headline"] = headline(record)
    slowest, cfg = record["estimates"]["slowest"], record["config"]
    body = [
        f"{len(record['ranks'])} ranks, {cfg['threads']} thread each, {cfg['rounds']} rounds x {cfg['iters']} call "
        f"per method after {cfg['warmup']} warm-up; wall time {record['wall_s']:.0f} s.",
        "",
        *table(
            "method | micro-batch, slowest rank (median)",
            [(m, fmt_value(slowest["median_s"][m], "s")) for m in METHODS],
        ),
        "",
        *table(
            "ratio | value [95 % CI]", [(k.replace("/", " / "), fmt_value(v)) for k, v in slowest["ratios"].items()]
        ),
    ]
    publish(out, record, TITLE, body)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("batchnorm.syncbn_lockstep", __doc__)
    p.add_argument("--net", choices=("resnet18", "template"), default="resnet18")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank (compare's ResNet-18 batch)")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    args = parse(p, argv, FULL, QUICK)
    if args.batch < 2:
        p.error(f"--batch must be >= 2 (BatchNorm needs 2 values per channel), got {args.batch}")
    config = args.cfg | {"net": args.net, "batch": args.batch, "threads": 1}

    def measure() -> dict[str, Any]:
        ranks = run_workers(_worker, 2, args=(config,), threads=1, timeout_s=1800.0)
        return {"ranks": ranks}

    return run_benchmark("batchnorm.syncbn_lockstep", config, argv, write, measure, args.out, args.max_wait_s)


if __name__ == "__main__":
    main()
