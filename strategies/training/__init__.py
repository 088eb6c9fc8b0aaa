"""The training side of ``custom_ddp``: gradients averaged as ``ddp`` averages them, and the layers around them.

- ``synced_training``: :class:`SyncedTraining`, the one gradient-sync component (every strategy hook it
  needs: wrapping, ``no_sync`` on accumulating micro-batches, the stop flag in the last bucket, buffers).
- ``layer_sync``: :class:`CustomSyncBatchNorm`, the ``LayerSync`` plugin that swaps BatchNorm layers for the
  core's :class:`parallel.batchnorm.syncbn.SyncBatchNorm`, and :class:`BatchNormSyncChoice`, which of the two
  plugins runs.
- ``uneven_training``: :class:`UnevenTraining`, uneven training data per rank: the loader joins (empty batches
  once a rank's data ends) and each step is weighed by the ranks that trained in it.
- ``zero1``: :func:`shard_optimizers`, ZeRO-1 for the configured optimizers.

May import: :mod:`parallel`, Lightning, :mod:`strategies.options` and :mod:`strategies.stopping` (the stop flag
a signal raises rides in the gradient buckets). Nothing outside this package imports its modules: use the names
below.
"""

from strategies.training.layer_sync import BatchNormSyncChoice, CustomSyncBatchNorm
from strategies.training.synced_training import SyncedTraining
from strategies.training.uneven_training import UnevenTraining
from strategies.training.zero1 import shard_optimizers

__all__ = ["BatchNormSyncChoice", "CustomSyncBatchNorm", "SyncedTraining", "UnevenTraining", "shard_optimizers"]
