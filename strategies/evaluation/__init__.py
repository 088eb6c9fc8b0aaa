"""The evaluation side of ``custom_ddp``: every sample evaluated once, every metric and gather exact.

- ``scatter_eval``: :class:`ScatterEvaluation`, the one scatter-evaluation component (rank 0 scatters the
  shards' sample indices, each rank reads its own samples, metrics sync from exact states);
  :func:`shard_loader`, a user's loader rebuilt around one rank's shard.
- ``uneven_gathers``: :class:`UnevenGathers`, the strategy's ``all_gather`` for shards of unequal lengths.

May import: :mod:`parallel`, Lightning, torchmetrics, :mod:`strategies.options` and :mod:`strategies.loaders`.
Nothing outside this package imports its modules: use the names below.
"""

from strategies.evaluation.scatter_eval import ScatterEvaluation, shard_loader
from strategies.evaluation.uneven_gathers import UnevenGathers

__all__ = ["ScatterEvaluation", "UnevenGathers", "shard_loader"]
