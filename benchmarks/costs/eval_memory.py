"""Per-rank peak-RSS growth while validating a large evaluation set under ``custom_ddp`` (2 CPU ranks).

    python -m benchmarks.costs.eval_memory          # about 30 seconds

Scatter evaluation sends sample *indices*: no rank should hold more of the evaluation set than it
reads. Each rank builds the same float32 set (``--mb`` MiB) in ``val_dataloader``; the kernel's
peak-RSS mark is reset right after, so the growth is what sharding and evaluation add. Linux only.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (registers custom_ddp)
from benchmarks.harness import parse, parser, run_benchmark
from benchmarks.report import fmt_bytes, headline_row, publish
from measure.memory import PeakMemory
from strategies.custom_ddp import CustomDDPStrategy

TITLE = "Peak RSS growth while validating under custom_ddp (2 CPU ranks)"
_SAMPLE_SHAPE = (3, 32, 32)
_MIB = 2**20


class _LargeEvalModule(pl.LightningModule):
    def __init__(self, num_samples: int, batch_size: int, out: Path) -> None:
        super().__init__()
        self.net, self.num_samples, self.batch_size, self.out = nn.Linear(3 * 32 * 32, 10), num_samples, batch_size, out
        self.probe, self.baseline = PeakMemory(torch.device("cpu"), method="kernel"), 0.0

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
        growth = self.probe.stop()["peak_bytes"] - self.baseline
        rank, threads = self.global_rank, torch.get_num_threads()
        record = {"rank": rank, "threads": threads, "baseline_bytes": self.baseline, "peak_growth_bytes": growth}
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(record))


def headline(record: dict) -> list[dict]:
    """Each rank's peak RSS growth while validating the set."""
    validated = f"peak RSS growth while validating {fmt_bytes(record['eval_set_bytes'])} under custom_ddp"
    return [
        headline_row(f"rank {r['rank']} ({r['threads']} intra-op threads): {validated}", r["peak_growth_bytes"], "B")
        for r in record["ranks"]
    ]


def _publish(record: dict, out: Path) -> None:  # not write(): kept as measured, the record has nothing to re-derive
    record["headline"] = headline(record)
    before = (
        f"{record['config']['num_samples']} float32 samples of {_SAMPLE_SHAPE}. Before scatter-by-indices (tree "
        "23514fd, which sent the samples from rank 0) the same command measured rank 0 +655.4 MiB and rank 1 "
        "+130.0 MiB."
    )
    publish(out, record, TITLE, [before])


def main(argv: list[str] | None = None) -> dict:
    p = parser("costs.eval_memory", __doc__)
    p.add_argument("--mb", type=float, default=260.0, help="evaluation set size in MiB (float32; --quick: 16)")
    p.add_argument("--batch-size", type=int, default=256)
    args = parse(p, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    num_samples = int((16.0 if args.quick else args.mb) * _MIB / (4 * torch.Size(_SAMPLE_SHAPE).numel()))
    strategy = CustomDDPStrategy(start_method="fork", timeout=300)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )

    def measure() -> dict:
        trainer.validate(_LargeEvalModule(num_samples, args.batch_size, args.out), verbose=False)
        ranks = [json.loads((args.out / f"rank{r}.json").read_text()) for r in range(2)]
        for r in range(2):
            (args.out / f"rank{r}.json").unlink()
        return {"eval_set_bytes": num_samples * 4 * torch.Size(_SAMPLE_SHAPE).numel(), "ranks": ranks}

    config = {"num_samples": num_samples, "batch_size": args.batch_size}
    return run_benchmark("costs.eval_memory", config, argv, _publish, measure, args.out, args.max_wait_s)


if __name__ == "__main__":
    main()
