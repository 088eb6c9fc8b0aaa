"""ZeRO stage 1: each rank keeps optimizer state for, and steps, only its shard of the parameters.

Gradients are still averaged in full on every rank (:mod:`parallel.gradients.grad_sync`); what is
sharded is the optimizer state (Adam's two moments, SGD's momentum), which is typically 1-2x
the model size and becomes ~1/world_size of it per rank::

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ...                                   # backward + SyncedDataParallel.finish()
    optimizer.step()                      # local shard steps, then owners broadcast shards
    optimizer.consolidate_state_dict(to=0)          # on every rank, for a checkpoint
    if rank == 0: torch.save(optimizer.state_dict(), path)
    optimizer.load_state_dict(torch.load(path))      # on every rank; each keeps its shard

Parameters go to ranks greedily, largest first to the least-loaded rank, so shards balance by
element count. After the local step each owner broadcasts its updated shard in flat ~25 MiB
chunks per dtype: a few large collectives instead of one per parameter, one chunk in flight. The
consolidated state dict has exactly the layout of ``optimizer_cls`` over the same parameters,
so a checkpoint also loads into the unsharded optimizer. Pure torch; no Lightning import.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from parallel.dist_utils import group_world_size
from parallel.gradients.buckets import assign_buckets
from parallel.sync_config import DEFAULT_BUCKET_CAP_MB

__all__ = ["ShardedOptimizer"]

# Parameters travel from their owner in flat chunks of about this size: bounded extra memory.
_SHARE_CHUNK_MB = DEFAULT_BUCKET_CAP_MB


class ShardedOptimizer(torch.optim.Optimizer):
    """Shard ``optimizer_cls``'s state and step across the ranks of ``process_group``.

    Args:
        params: Parameters or parameter-group dicts, as for any optimizer.
        optimizer_cls: The optimizer class to shard, e.g. ``torch.optim.AdamW``.
        process_group: Group to shard over; the default group when ``None``. Without an
            initialised ``torch.distributed`` it behaves like plain ``optimizer_cls``.
        **defaults: Keyword arguments of ``optimizer_cls`` (``lr``, ``weight_decay``, ...).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_cls: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        is_class = isinstance(optimizer_cls, type)
        if not (is_class and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"optimizer_cls={optimizer_cls!r} must be a torch.optim.Optimizer subclass "
                "(pass the class, e.g. torch.optim.AdamW, not an instance)"
            )
        self._process_group = process_group
        self._world_size = group_world_size(process_group)
        self._rank = dist.get_rank(process_group) if self._world_size > 1 else 0
        self._owner: dict[int, int] = {}  # id(param) -> rank that steps it
        self._load = [0] * self._world_size  # elements owned per rank
        self._local: torch.optim.Optimizer | None = None
        self._consolidated: dict[str, Any] | None = None
        super().__init__(params, defaults)  # calls add_param_group for each group
        self._local = optimizer_cls([self._local_group(g) for g in self.param_groups], **defaults)
        self._adopt_local_hyperparameters()

    @classmethod
    def from_optimizer(
        cls, optimizer: torch.optim.Optimizer, process_group: dist.ProcessGroup | None = None
    ) -> ShardedOptimizer:
        """Shard an existing optimizer: same class, parameter groups, hyperparameters and state.

        ``optimizer.defaults`` can hold keys its constructor does not take (AdamW records
        ``decoupled_weight_decay``); those stay in the parameter groups, where the class reads them.
        """
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        sharded = cls(optimizer.param_groups, type(optimizer), process_group, **defaults)
        if optimizer.state:  # already stepped: keep the moments, each rank its shard
            sharded.load_state_dict(optimizer.state_dict())
        return sharded

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The ``optimizer_cls`` instance over this rank's shard."""
        assert self._local is not None
        return self._local

    def owner(self, param: torch.Tensor) -> int:
        """Rank (in the group) that holds ``param``'s optimizer state and steps it."""
        return self._owner[id(param)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # Largest first onto the least-loaded rank; ties to the lowest rank, so every rank
        # computes the same assignment. Existing shards never move.
        for param in sorted(group["params"], key=lambda p: -p.numel()):
            rank = min(range(self._world_size), key=lambda r: self._load[r])
            self._owner[id(param)] = rank
            self._load[rank] += param.numel()
        if self._local is not None:
            self._local.add_param_group(self._local_group(group))
            self._adopt_local_hyperparameters()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (if given), step the local shard, then share the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Schedulers and users edit self.param_groups: forward every hyperparameter.
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local_group.update({k: v for k, v in group.items() if k != "params"})
        self.local_optimizer.step()
        self._share_params()
        self._consolidated = None  # any consolidated state is stale now
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every shard's state on group rank ``to``; call on every rank (a collective)."""
        if not 0 <= to < self._world_size:
            raise ValueError(f"to={to} is not a rank of this group of {self._world_size} ranks")
        shard = {
            index: {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
            for index, state in self._state_by_global_index().items()
        }
        shards = [shard]
        if self._world_size > 1:
            shards = [None] * self._world_size if self._rank == to else None
            dist.gather_object(shard, shards, dst=self._global_rank(to), group=self._process_group)
        if self._rank != to:
            self._consolidated = None
            return
        state = {index: s for one in shards for index, s in one.items()}
        self._consolidated = {
            "state": dict(sorted(state.items())),
            "param_groups": self._indexed_groups(),
        }

    def state_dict(self) -> dict[str, Any]:
        """The full state consolidated by :meth:`consolidate_state_dict` on this rank."""
        if self._consolidated is None:
            raise RuntimeError(
                "ShardedOptimizer.state_dict() needs the shards gathered first: call "
                "consolidate_state_dict(to=rank) on every rank after the last step, then "
                "state_dict() on that rank"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (consolidated or unsharded) state; every rank keeps only its shard."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(groups)} param groups, this optimizer "
                f"{len(self.param_groups)}: build it with the checkpoint's parameter groups"
            )
        local_state, local_groups, next_local = {}, [], 0
        for group, saved in zip(self.param_groups, groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group sizes differ: checkpoint {len(saved['params'])}, optimizer {len(group['params'])}"
                )
            hyper = {k: v for k, v in saved.items() if k != "params"}
            group.update(hyper)
            local_indices = []
            for param, index in zip(group["params"], saved["params"], strict=True):
                if self.owner(param) == self._rank:
                    if index in state_dict["state"]:
                        local_state[next_local] = state_dict["state"][index]
                    local_indices.append(next_local)
                    next_local += 1
            local_groups.append({**hyper, "params": local_indices})
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local_optimizer.state

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        owned = [p for p in group["params"] if self._owner[id(p)] == self._rank]
        return {**{k: v for k, v in group.items() if k != "params"}, "params": owned}

    def _adopt_local_hyperparameters(self) -> None:
        """Show ``optimizer_cls``'s own defaults in ``param_groups``; share its state dict."""
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            for key, value in local_group.items():
                group.setdefault(key, value)
        self.state = self.local_optimizer.state  # type: ignore[assignment]

    def _global_indices(self) -> dict[int, int]:
        """id(param) -> its index in a full state dict (params numbered across groups)."""
        params = (p for group in self.param_groups for p in group["params"])
        return {id(p): index for index, p in enumerate(params)}

    def _state_by_global_index(self) -> dict[int, dict[str, Any]]:
        index_of = self._global_indices()
        return {index_of[id(p)]: state for p, state in self.local_optimizer.state.items()}

    def _indexed_groups(self) -> list[dict[str, Any]]:
        # Hyperparameters from self.param_groups, the ones schedulers edit: the local groups
        # only receive them at the next step() and may be one scheduler step behind.
        index_of = self._global_indices()
        return [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [index_of[id(p)] for p in group["params"]],
            }
            for group in self.param_groups
        ]

    def _share_params(self) -> None:
        """Each owner broadcasts its updated shard, flattened in chunks of ~25 MiB per dtype.

        Broadcasts rather than one all-gather: an all-gather needs the whole padded model as a
        receive buffer, which would spend the memory ZeRO saves; here one chunk is in flight.
        """
        if self._world_size == 1:
            return
        by_kind: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = defaultdict(
            lambda: [[] for _ in range(self._world_size)]
        )
        for group in self.param_groups:
            for p in group["params"]:
                by_kind[(p.device, p.dtype)][self._owner[id(p)]].append(p)
        for shards in by_kind.values():
            for rank, shard in enumerate(shards):
                for chunk in assign_buckets(shard, _SHARE_CHUNK_MB, _SHARE_CHUNK_MB):
                    self._broadcast_params([shard[i] for i in chunk], rank)

    def _broadcast_params(self, params: list[torch.Tensor], owner: int) -> None:
        if owner == self._rank:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
        else:
            flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        dist.broadcast(flat, src=self._global_rank(owner), group=self._process_group)
        if owner != self._rank:
            for p, values in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.copy_(values.view_as(p))

    def _global_rank(self, group_rank: int) -> int:
        group = self._process_group
        return group_rank if group is None else dist.get_global_rank(group, group_rank)
