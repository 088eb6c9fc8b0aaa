"""Small LightningModules for ``test_conformance_fit.py`` and ``test_conformance_eval.py`` beside them (their data:
``tests/conformance_data.py``).

They are written from Lightning's documented API only and know nothing about ``custom_ddp``:
each must behave the same under Lightning's ``ddp``, under ``custom_ddp`` and (where a result is
defined) in one process. Data lives in the module (made in the parent before fork) so that every
rank and every strategy sees the same samples; weights are seeded in ``__init__``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from conformance_data import NUM_CLASSES, NUM_FEATURES, IndexedClassification, unpack
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from parallel.torch_compat import make_norm


def _eval_metrics() -> nn.ModuleDict:
    return nn.ModuleDict(
        {"acc": MulticlassAccuracy(NUM_CLASSES, top_k=1, average="micro"), "loss": MeanMetric(), "count": SumMetric()}
    )


class ClassifierModule(pl.LightningModule):
    """Linear classifier (optionally BatchNorm1d first) on IndexedClassification data.

    Logs torchmetrics objects (accuracy, mean loss, sample count) in validation/test, one set per
    validation dataloader (several when ``val_sizes`` has several entries). With ``out_dir``
    each rank writes the sample indices and the batch count it evaluated per stage and loader
    (``{stage}_rank{r}.json``, the last non-sanity epoch) and, during sanity checking,
    ``sanity_rank{r}.json``.
    """

    def __init__(
        self,
        kind: str = "tuple",
        train_size: int = 16,
        val_sizes: tuple[int, ...] = (11,),
        test_size: int = 11,
        batch_size: int = 4,
        eval_batch_size: int = 4,
        batchnorm: bool = False,
        optimizer: str = "sgd",
        out_dir: Path | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.net = nn.Sequential(
            nn.BatchNorm1d(NUM_FEATURES) if batchnorm else nn.Identity(), nn.Linear(NUM_FEATURES, NUM_CLASSES)
        )
        self.train_set = IndexedClassification(train_size, kind, seed=1)
        self.val_sets = [IndexedClassification(n, kind, seed=10 + i) for i, n in enumerate(val_sizes)]
        self.test_set = IndexedClassification(test_size, kind, seed=20)
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.optimizer_name = optimizer
        self.out_dir = out_dir
        self.val_metrics = nn.ModuleList(_eval_metrics() for _ in val_sizes)
        self.test_metrics = _eval_metrics()
        self._seen: dict[int, list[int]] = {}
        self._batches: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = unpack(batch, self.kind)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: Any, metrics: nn.ModuleDict, prefix: str, dataloader_idx: int) -> None:
        x, y, idx = unpack(batch, self.kind)
        logits = self(x)
        metrics["acc"](logits, y)
        metrics["loss"](F.cross_entropy(logits, y, reduction="none"))
        metrics["count"](torch.tensor(float(y.numel())))
        for name, metric in metrics.items():
            self.log(f"{prefix}_{name}", metric)
        self._seen.setdefault(dataloader_idx, []).extend(int(i) for i in idx)
        self._batches[dataloader_idx] = self._batches.get(dataloader_idx, 0) + 1

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, self.val_metrics[dataloader_idx], "val", dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate(batch, self.test_metrics, "test", dataloader_idx)

    def on_validation_epoch_start(self) -> None:
        self._seen, self._batches = {}, {}

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._dump("sanity" if self.trainer.sanity_checking else "val")

    def on_test_epoch_end(self) -> None:
        self._dump("test")

    def _dump(self, stage: str) -> None:
        if self.out_dir is None:
            return
        trainer = self.trainer
        if stage == "sanity":
            expected = trainer.num_sanity_val_batches
        else:
            expected = trainer.num_test_batches if stage == "test" else trainer.num_val_batches
        record = {
            "seen": {str(k): v for k, v in self._seen.items()},
            "batches": {str(k): v for k, v in self._batches.items()},
            "num_batches": [int(n) for n in expected],
        }
        (self.out_dir / f"{stage}_rank{self.global_rank}.json").write_text(json.dumps(record))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        loaders = [DataLoader(s, batch_size=self.eval_batch_size) for s in self.val_sets]
        return loaders[0] if len(loaders) == 1 else loaders

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.eval_batch_size)


def read_records(out_dir: Path, stage: str, world_size: int = 2) -> list[dict]:
    return [json.loads((out_dir / f"{stage}_rank{rank}.json").read_text()) for rank in range(world_size)]


class SyncDistModule(pl.LightningModule):
    """Logs a plain tensor (the batch mean loss) with ``sync_dist=True``; no torchmetrics at all.

    Each rank writes the per-sample losses it evaluated to ``out_dir/losses_rank{r}.json``.
    """

    def __init__(self, num_samples: int, batch_size: int, out_dir: Path, on_step: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(NUM_FEATURES, NUM_CLASSES)
        self.data = IndexedClassification(num_samples, "tuple", seed=3)
        self.batch_size, self.out_dir, self.on_step = batch_size, out_dir, on_step
        self._losses: list[float] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        self._losses.extend(losses.tolist())
        self.log("val_loss", losses.mean(), sync_dist=True, on_step=self.on_step, on_epoch=True, batch_size=len(y))

    def on_validation_epoch_end(self) -> None:
        (self.out_dir / f"losses_rank{self.global_rank}.json").write_text(json.dumps(self._losses))
        self._losses = []

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class ManualModule(pl.LightningModule):
    """Manual optimization with one optimizer (``automatic_optimization = False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES))
        self.data = IndexedClassification(24, "tuple", seed=4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y, _ = batch
        loss = F.cross_entropy(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("loss", loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=3)


class _GanData(Dataset):
    """(real sample, latent code) pairs: the noise is data, so every strategy uses the same."""

    def __init__(self, n: int = 24) -> None:
        generator = torch.Generator().manual_seed(5)
        self.real = torch.randn(n, NUM_FEATURES, generator=generator) * 0.5 + 1.0
        self.z = torch.randn(n, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.z)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.real[i], self.z[i]


class TinyGAN(pl.LightningModule):
    """Two optimizers, manual optimization, toggle/untoggle around each (Lightning's GAN pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, NUM_FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        self.data = _GanData()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        g_opt, d_opt = self.optimizers()
        ones, zeros = torch.ones(len(z), 1), torch.zeros(len(z), 1)

        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        fake = self.generator(z).detach()
        d_loss = (
            F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
            + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        ) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.9)),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.5),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


class ConvBNModule(pl.LightningModule):
    """Conv -> ``BatchNorm2d(C, bias=False)`` -> pool -> linear, trained with momentum SGD."""

    def __init__(self, batch_size: int, num_samples: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False),
            make_norm(nn.BatchNorm2d, 4, bias=False),  # torch < 2.12: no bias= (parallel.torch_compat)
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 2),
        )
        generator = torch.Generator().manual_seed(6)
        self.images = torch.randn(num_samples, 3, 5, 5, generator=generator) * 2 + 0.5
        self.labels = torch.randint(0, 2, (num_samples,), generator=generator)
        self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        # Sharded by hand (run with use_distributed_sampler=False; Lightning's sampler would
        # shuffle): rank r of W takes samples r, r+W, ..., so global batch t of W ranks is the
        # one-process batch t of W * batch_size samples.
        samples = list(zip(self.images, self.labels, strict=True))
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(samples[rank::world_size], batch_size=self.batch_size)


class UnusedParamsModule(pl.LightningModule):
    """One parameter no rank uses, one that only global rank 1 uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(NUM_FEATURES, NUM_CLASSES)
        self.never_used = nn.Parameter(torch.ones(NUM_CLASSES))
        self.rank1_only = nn.Parameter(torch.zeros(NUM_CLASSES))
        self.data = IndexedClassification(16, "tuple", seed=7)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        logits = self.net(x)
        if self.global_rank == 1:
            logits = logits + self.rank1_only
        return F.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)
