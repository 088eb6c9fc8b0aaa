"""Per-rank peak-RSS growth while validating a large evaluation set under ``custom_ddp`` (2 CPU ranks).

Scatter evaluation sends sample *indices*: no rank should hold more of the evaluation set than
it reads. Each rank builds the same float32 evaluation set (``--mb`` MiB) in ``val_dataloader``;
the kernel's peak-RSS mark is reset right after, so the growth counts what sharding and
evaluation add (loader set-up included), not the dataset itself::

    python -m benchmarks.eval_memory --out benchmarks/results/eval_memory

Writes ``results.json`` and ``results.md`` (:mod:`benchmarks.harness`). Linux only (``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (registers custom_ddp)
from benchmarks.harness import make_record, markdown_header, table, wait_for_quiet, write_record
from callbacks.memory import PeakMemory
from strategies.custom_ddp import CustomDDPStrategy

_SAMPLE_SHAPE = (3, 32, 32)
_MIB = 2**20


class _LargeEvalModule(pl.LightningModule):
    def __init__(self, num_samples: int, batch_size: int, out: Path) -> None:
        super().__init__()
        self.net = nn.Linear(3 * 32 * 32, 10)
        self.num_samples, self.batch_size, self.out = num_samples, batch_size, out
        self.probe = PeakMemory(torch.device("cpu"), method="kernel")
        self.baseline = 0.0

    def val_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(self.num_samples, *_SAMPLE_SHAPE, generator=generator)
        labels = torch.randint(0, 10, (self.num_samples,), generator=generator)
        self.baseline = self.probe.current()
        self.probe.start()  # from here on: sharding + evaluation
        return DataLoader(TensorDataset(images, labels), batch_size=self.batch_size)

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_loss", F.cross_entropy(self.net(images.flatten(1)), labels), sync_dist=True)

    def on_validation_end(self) -> None:
        peak = self.probe.stop()["peak_bytes"]
        record = {"rank": self.global_rank, "baseline_mib": self.baseline / _MIB,
                  "peak_growth_mib": (peak - self.baseline) / _MIB}
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/eval_memory"))
    parser.add_argument("--mb", type=float, default=260.0, help="evaluation set size in MiB (float32)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-wait-s", type=float, default=300.0, help="wait this long for a quiet machine")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    num_samples = int(args.mb * _MIB / (4 * torch.Size(_SAMPLE_SHAPE).numel()))
    strategy = CustomDDPStrategy(start_method="fork", timeout=timedelta(seconds=300))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    quiet = wait_for_quiet(max_wait_s=args.max_wait_s)
    started = time.perf_counter()
    trainer.validate(_LargeEvalModule(num_samples, args.batch_size, args.out), verbose=False)
    ranks = [json.loads((args.out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        (args.out / f"rank{r}.json").unlink()
    set_mib = num_samples * 4 * torch.Size(_SAMPLE_SHAPE).numel() / _MIB
    headline = {f"rank{r['rank']}_peak_rss_growth_mib": round(r["peak_growth_mib"], 1) for r in ranks}
    record = make_record("eval_memory", vars(args) | {"out": str(args.out)}, quiet.finish(),
                         headline={"eval_set_mib": round(set_mib, 1), **headline}, num_samples=num_samples,
                         wall_s=time.perf_counter() - started, ranks=ranks)
    lines = markdown_header(record, f"Peak RSS growth while validating {set_mib:.0f} MiB on 2 ranks (custom_ddp)")
    lines += [f"{num_samples} float32 samples of {_SAMPLE_SHAPE}; the kernel's peak-RSS mark is reset after "
              "each rank built the evaluation set, so the growth is what sharding and evaluation add.", "",
              *table(["rank", "peak RSS growth (MiB)"], [[r["rank"], f"{r['peak_growth_mib']:.1f}"] for r in ranks]),
              "", "Before scatter-by-indices (tree 23514fd, which sent the samples from rank 0) the same command "
              "measured rank 0 +655.4 MiB and rank 1 +130.0 MiB."]
    write_record(args.out, record, lines)
    print("\n".join(lines))

if __name__ == "__main__":
    main()
