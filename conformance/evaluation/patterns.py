"""Evaluation patterns Lightning users write every day, for the conformance table and its tests.

:class:`PatternModule` evaluates 11 samples (binary labels, batches of 4) with a fixed linear
model and, in one validation run, exercises every kind of torchmetrics state and wrapper, the
gathers of Lightning's docs and the hooks users update metrics in. Two ranks get 6 and 5 samples
under ``custom_ddp`` (6 and 6, one duplicate, under ``ddp``). What a rank gathers is written to
``out_dir`` so the parent process can read it. The module knows nothing about the strategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric, MetricCollection
from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, RunningMean, SumMetric
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    BinaryAveragePrecision,
    BinaryF1Score,
    MulticlassAccuracy,
)
from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef
from torchmetrics.retrieval import RetrievalMAP
from torchmetrics.wrappers import ClasswiseWrapper, MinMaxMetric, MultitaskWrapper

__all__ = [
    "NUM_SAMPLES",
    "CallbackAUROC",
    "DropLastModule",
    "IteratorStepsModule",
    "MeanStateMetric",
    "PatternModule",
    "TwoLoadersModule",
    "ValidateInsideFit",
    "VariableWidthGather",
    "dataset",
]

NUM_SAMPLES = 11
BATCH_SIZE = 4


def dataset(n: int = NUM_SAMPLES, seed: int = 0) -> TensorDataset:
    """``(features, label, index)`` rows; the labels are not separable by the fixed model."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 4, generator=generator), torch.randint(0, 2, (n,), generator=generator), torch.arange(n)
    )


class MeanStateMetric(Metric):
    """A state reduced by ``"mean"`` across ranks: not mergeable exactly (torchmetrics' own sync)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("batch_mean_sum", torch.tensor(0.0), dist_reduce_fx="mean")
        self.add_state("batches", torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, values: torch.Tensor) -> None:
        self.batch_mean_sum += values.mean()
        self.batches += 1

    def compute(self) -> torch.Tensor:
        return self.batch_mean_sum / self.batches


def _metrics() -> nn.ModuleDict:
    accuracy_f1 = BinaryAccuracy() + BinaryF1Score()  # a compositional metric
    return nn.ModuleDict(
        {
            "auroc": BinaryAUROC(),
            "ap": BinaryAveragePrecision(),
            "auroc_cpu": BinaryAUROC(compute_on_cpu=True),
            "auroc_own_group": BinaryAUROC(),  # its process_group is set in setup(), once one exists
            "retrieval_map": RetrievalMAP(),  # list states reduced by None: one gather per update in torchmetrics
            "pearson": PearsonCorrCoef(),  # tensor states reduced by None (its own merge of moments)
            "max": MaxMetric(),
            "min": MinMetric(),
            "mean_step_synced": MeanMetric(dist_sync_on_step=True),
            "local_acc": BinaryAccuracy(sync_on_compute=False),
            "mean_state": MeanStateMetric(),
            "running_mean": RunningMean(window=2),
            "minmax": MinMaxMetric(BinaryAccuracy()),
            "collection": MetricCollection({"f1": BinaryF1Score(), "ap": BinaryAveragePrecision()}),
            "collection_nogroups": MetricCollection(
                {"f1": BinaryF1Score(), "ap": BinaryAveragePrecision()}, compute_groups=False
            ),
            "classwise": ClasswiseWrapper(MulticlassAccuracy(num_classes=2, average=None), labels=["neg", "pos"]),
            "multitask": MultitaskWrapper({"acc": BinaryAccuracy(), "mse": MeanSquaredError()}),
            "accuracy_plus_f1": accuracy_f1,
            "epoch_end_ap": BinaryAveragePrecision(),
            "batch_end_auroc": BinaryAUROC(),
        }
    )


class PatternModule(pl.LightningModule):
    """Validation only: every metric pattern at once; gathers and counts written to ``out_dir``."""

    def __init__(self, out_dir: str | Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        with torch.no_grad():
            self.net.bias.add_(0.6)  # scores around 0.5: both predicted classes occur
        self.out_dir = Path(out_dir)
        self.metrics = _metrics()
        self.scores: list[torch.Tensor] = []

    def setup(self, stage: str) -> None:
        if torch.distributed.is_initialized():  # a metric built with a process group of its own
            self.metrics["auroc_own_group"].process_group = torch.distributed.new_group(backend="gloo")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features, labels, _ = batch
        scores = torch.sigmoid(self.net(features).squeeze(1))
        m = self.metrics
        for name in ("auroc", "ap", "auroc_cpu", "auroc_own_group", "local_acc", "minmax", "accuracy_plus_f1"):
            m[name].update(scores, labels)
        for name in ("max", "min", "mean_step_synced", "mean_state", "running_mean"):
            m[name].update(scores)
        m["collection"].update(scores, labels)
        m["collection_nogroups"].update(scores, labels)
        m["classwise"].update(torch.stack([1 - scores, scores], 1), labels)
        m["multitask"].update({"acc": scores, "mse": scores}, {"acc": labels, "mse": labels.float()})
        m["epoch_end_ap"].update(scores, labels)
        m["retrieval_map"].update(scores, labels, indexes=batch[2] // 3)  # queries of 3 documents
        m["pearson"].update(scores, labels.float())
        self.scores.append(scores)
        self.log("sync_dist_mean", scores.mean(), sync_dist=True, batch_size=len(scores))
        self.log("step_sync_dist", scores.sum(), on_step=True, on_epoch=True, sync_dist=True, reduce_fx="sum")
        for name in (
            "auroc",
            "ap",
            "auroc_cpu",
            "auroc_own_group",
            "retrieval_map",
            "pearson",
            "max",
            "min",
            "mean_step_synced",
            "local_acc",
            "mean_state",
            "running_mean",
            "accuracy_plus_f1",
        ):
            self.log(name, m[name], batch_size=len(scores))
        return scores

    def on_validation_batch_end(
        self, outputs: torch.Tensor, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.metrics["batch_end_auroc"].update(outputs, batch[1])

    def on_validation_epoch_end(self) -> None:
        m = self.metrics
        for name in ("minmax", "collection", "collection_nogroups", "classwise", "multitask"):
            values = m[name].compute()
            self.log_dict({f"{name}/{key}": value for key, value in values.items()})
            m[name].reset()
        for name in ("epoch_end_ap", "batch_end_auroc"):
            self.log(name, m[name].compute())
            m[name].reset()
        self._gather(torch.cat(self.scores))
        self.scores = []

    def _gather(self, scores: torch.Tensor) -> None:
        """Lightning docs' pattern: ``self.all_gather`` of per-sample outputs (and the exact gather)."""
        gathered = self.all_gather(scores)
        record = {"all_gather_shape": list(gathered.shape), "all_gather_sum": float(gathered.sum())}
        exact = getattr(self.trainer.strategy, "all_gather_samples", None)
        if exact is not None:
            rows = exact(scores)
            record.update(all_gather_samples_rows=len(rows), all_gather_samples_sum=float(rows.sum()))
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            (self.out_dir / "gather.json").write_text(json.dumps(record))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE)


class CallbackAUROC(Callback):
    """A metric owned by a callback, updated from the step outputs, computed and logged at epoch end."""

    def __init__(self) -> None:
        self.auroc = BinaryAUROC()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any):
        batch = args[0]  # then batch_idx, dataloader_idx
        self.auroc.update(outputs, batch[1])

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("callback_auroc", self.auroc.compute())
        self.auroc.reset()


class IteratorStepsModule(pl.LightningModule):
    """``dataloader_iter`` validation steps; a test step for loaders that are plain lists (``trainer.test(m, [0])``).

    Trains (one step per batch of 4) so that callbacks of ``fit`` can be exercised too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.count = SumMetric()

    def validation_step(self, dataloader_iter: Any) -> None:
        batch, _, _ = next(dataloader_iter)
        self.count.update(torch.tensor(float(len(batch[0]))))
        self.log("count", self.count)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.count.update(torch.tensor(1.0))
        self.log("count", self.count)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(8), batch_size=BATCH_SIZE)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE)


class ValidateInsideFit(Callback):
    """A second Trainer call from a callback while ``fit`` runs."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.validate(pl_module, dataloaders=DataLoader(dataset(), batch_size=BATCH_SIZE), verbose=False)


class VariableWidthGather(PatternModule):
    """``self.all_gather`` of outputs whose second dimension differs by rank (variable-length outputs)."""

    def on_validation_epoch_end(self) -> None:
        self.all_gather(torch.zeros(2, 2 + self.global_rank))


class TwoLoadersModule(pl.LightningModule):
    """Two validation loaders (11 and 7 samples, batches of 4 and 3), a metric object per loader in ``nn.ModuleList``s
    indexed by ``dataloader_idx`` (Lightning's docs' pattern); Lightning names each value ``<name>/dataloader_idx_<i>``.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.accuracy = nn.ModuleList([BinaryAccuracy(), BinaryAccuracy()])
        self.auroc = nn.ModuleList([BinaryAUROC(), BinaryAUROC()])

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        features, labels, _ = batch
        scores = torch.sigmoid(self.net(features)).squeeze(1)
        self.accuracy[dataloader_idx].update(scores, labels)
        self.auroc[dataloader_idx].update(scores, labels)
        self.log("accuracy", self.accuracy[dataloader_idx])
        self.log("auroc", self.auroc[dataloader_idx])
        self.log("loss", nn.functional.binary_cross_entropy(scores, labels.float()), sync_dist=True)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(dataset(), batch_size=BATCH_SIZE), DataLoader(dataset(7, seed=1), batch_size=3)]


class DropLastModule(pl.LightningModule):
    """A validation loader with ``drop_last=True`` (11 samples, batches of 4: one process evaluates samples 0-7);
    logs the sum of the evaluated samples' indices, which tells which samples were evaluated."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.index_sum = SumMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.index_sum.update(batch[2].sum().float())
        self.log("index_sum", self.index_sum)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=BATCH_SIZE, drop_last=True)
