"""What ``desync_check=True`` costs per optimizer step: torch's collective fingerprint check on gloo.

Two CPU ranks (fork + gloo, 1 thread each) run custom_ddp's training step by hand: Lightning's
per-batch flag broadcast, forward through SyncBatchNorm (one all_gather per BatchNorm layer),
backward (one all_reduce per layer), the bucketed gradient all-reduce with the rank-status slots,
SGD. The same process group is created with and without ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
(``dist.set_debug_level`` before ``init_process_group``, which is what the strategy option does),
in interleaved rounds; a sample is the slowest rank's barrier-aligned step time. As in the strategy,
the buckets are summed in shared memory without the check (``grad_transport="auto"``) and by the
process group with it, where the check sees them. Nets: the
quickstart's template net (batch 128 per rank, 1 BatchNorm layer) and CIFAR ResNet-18 (batch 8
per rank, 20 BatchNorm layers: the per-collective cost shows)::

    python -m benchmarks.costs.desync_cost          # about 2 minutes on 2 cores
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness, report
from collectives.launcher import run_workers
from lit_cifar.nets import CifarResNet18, TemplateNet
from measure.stats import difference_ci, median_ci, ratio_ci
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.gradients.grad_sync import SyncedDataParallel
from strategies.options import CustomDDPOptions

NETS = {"template": (TemplateNet, 128), "resnet18": (CifarResNet18, 8)}
MODES = ("off", "detail")
TITLE = "Cost of desync_check per optimizer step"


def _steps_worker(rank: int, world_size: int, net: str, warmup: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    factory, batch = NETS[net]
    checked = dist.get_debug_level() == dist.DebugLevel.DETAIL  # inherited from _measure through fork
    transport = CustomDDPOptions(desync_check=checked).grad_sync.grad_transport  # the strategy's choice
    layers = SyncBatchNorm.convert(factory(num_classes=100))
    model = SyncedDataParallel(layers, carry_rank_status=True, grad_transport=transport)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 100, (batch,))
    flag = torch.zeros(1, dtype=torch.int64)

    def step() -> None:
        dist.broadcast(flag, src=0)  # Lightning's per-batch SIGTERM flag
        nn.functional.cross_entropy(model(x), y).backward()
        model.finish()
        optimizer.step()
        optimizer.zero_grad()

    times = harness.timed_rounds({"step": step}, {"warmup": warmup, "rounds": 1, "iters": steps})["step"]
    collectives = 1 + 2 * sum(isinstance(m, SyncBatchNorm) for m in model.modules()) + len(model.buckets)
    return {"times": times, "collectives": collectives}


def _measure(net: str, mode: str, warmup: int, steps: int) -> dict[str, Any]:
    dist.set_debug_level(dist.DebugLevel.DETAIL if mode == "detail" else dist.DebugLevel.OFF)
    try:  # fork: the workers inherit the debug level and wrap their process group with it
        per_rank = run_workers(_steps_worker, 2, args=(net, warmup, steps), timeout_s=600)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return {"times": harness.slowest_ranks(per_rank, ["times"])["times"], "collectives": per_rank[0]["collectives"]}


def _net_row(net: str, rounds: int, steps: int) -> dict[str, Any]:
    """One net's step with the check and without, in interleaved rounds of fresh process groups."""
    runs = harness.interleave(MODES, rounds, lambda mode, _: _measure(net, mode, 2, steps))
    off, on = ([run["times"] for run in runs[mode]] for mode in MODES)  # runs: resampled whole
    return {
        "net": net,
        "batch": NETS[net][1],
        "collectives": runs["off"][0]["collectives"],
        "threads": 1,
        "off_s": asdict(median_ci(off)),
        "detail_s": asdict(median_ci(on)),
        "cost_s": asdict(difference_ci(on, off)),
        "ratio": asdict(ratio_ci(on, off)),
    }


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per net: the step with the check against without it (ratio, and seconds per step and per collective)."""
    return [
        report.headline_row(
            f"{r['net']} (batch {r['batch']} per rank, {r['collectives']} collectives per step): {what}", value, unit
        )
        for r in record["rows"]
        for what, value, unit in (
            ("step with desync_check / without", r["ratio"], "x"),
            ("added time per step", r["cost_s"], "s"),
            ("added time per collective", r["cost_s"]["value"] / r["collectives"], "s"),
        )
    ]


def _publish(record: dict[str, Any], out: Path) -> None:  # not write(): the record keeps no samples to re-derive
    record["headline"] = headline(record)
    report.publish(out, record, TITLE, [])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, rounds, steps = harness.parse_step_rounds("costs.desync_cost", __doc__, argv, rounds=4, steps=8, quick=(1, 2))
    measure = lambda: {"rows": [_net_row(net, rounds, steps) for net in NETS]}  # noqa: E731
    config = {"rounds": rounds, "steps": steps}
    return harness.run_benchmark(
        "costs.desync_cost", config, argv, _publish, measure, args.out, args.max_wait_s, timed=False
    )


if __name__ == "__main__":
    main()
