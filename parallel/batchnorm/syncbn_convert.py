"""How :meth:`SyncBatchNorm.convert <parallel.batchnorm.syncbn.SyncBatchNorm.convert>` and ``revert`` walk a model:
every submodule slot replaced once per module, a layer's state handed from the layer it replaces.

Pure torch; imports only ``parallel.torch_compat``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.lazy import LazyModuleMixin

from parallel.torch_compat import make_norm

__all__ = ["BatchNormXd", "defines_dim_check", "move_state", "original_of", "replace_modules", "replacement"]


def replace_modules(
    module: nn.Module,
    replace: Callable[[nn.Module], nn.Module],
    children_first: bool = False,
    done: dict[int, tuple[nn.Module, nn.Module]] | None = None,
) -> nn.Module:
    """``replace(module)``, with every submodule slot in the tree set to its own replacement.

    Each module is replaced once, so a module in several slots, of several parents or under two names of one,
    gets the same replacement in all of them (``done``: by the replaced module's id, that module, kept alive so its
    id is not reused during the walk, and its replacement). The slots are read from ``_modules``:
    ``named_children()`` lists a module once per parent, under its first name.
    ``children_first``: replace a module after its children (a reverted layer takes the reverted children),
    not before (a converted layer's children are then walked).
    """
    done = {} if done is None else done
    original = module
    if id(original) in done:
        return done[id(original)][1]
    if not children_first:
        module = replace(module)
    for name, child in list(module._modules.items()):
        if child is not None:
            setattr(module, name, replace_modules(child, replace, children_first, done))
    done[id(original)] = (original, replace(module) if children_first else module)
    return done[id(original)][1]


def replacement(module: _BatchNorm, layer_class: type[_BatchNorm], **options: Any) -> _BatchNorm:
    """A ``layer_class(..., **options)`` holding ``module``'s state (:func:`move_state`) and ``module`` itself, for
    :func:`original_of` to give back."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(
            f"Cannot convert {type(module).__name__} to SyncBatchNorm: its parameters are "
            f"not initialised yet (lazy module); run one forward pass on a sample batch "
            f"before SyncBatchNorm.convert."
        )
    args = (module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
    # device="meta": replaced by the shared tensors next, nothing allocated twice.
    layer = layer_class(*args, device="meta", bias=module.bias is not None, **options)  # takes bias on any torch
    move_state(module, layer)
    object.__setattr__(layer, "_original_module", module)  # not a submodule: not in state_dict or modules()
    return layer


def original_of(layer: _BatchNorm, torch_class: type[_BatchNorm]) -> _BatchNorm:
    """The layer :func:`replacement` made ``layer`` from (a new ``torch_class`` for one built directly), holding
    ``layer``'s current state."""
    original = layer._original_module
    if original is None:
        args = (layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
        original = make_norm(torch_class, *args, device="meta", bias=layer.bias is not None)
    move_state(layer, original)
    return original


class BatchNormXd(_BatchNorm):
    """BatchNorm for any input rank: what :meth:`SyncBatchNorm.revert` makes of a layer that
    was not created by :meth:`SyncBatchNorm.convert`."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected a 2D-5D input (N, C, *), got {input.dim()}D")


def defines_dim_check(module: nn.Module) -> bool:
    """Whether ``module``'s class has its own ``_check_input_dim`` (``_NormBase``'s only raises)."""
    return type(module)._check_input_dim is not _NormBase._check_input_dim


# nn.Module's hook registries (forward, pre-forward, backward, state-dict, load hooks; the set differs between torch
# versions), read from a fresh module, and the flag saying which kind of backward hook it holds.
_HOOK_SLOTS = tuple(name for name in vars(nn.Module()) if "hook" in name)


def move_state(source: _BatchNorm, target: _BatchNorm) -> None:
    """Point ``target``'s parameters, buffers, children and hooks at ``source``'s; copy its flags."""
    # Shared tensors keep their device, dtype and requires_grad. A None (bias=False, no running
    # stats) is set as well: `target` may be an original whose slot was a tensor.
    for name in ("weight", "bias"):
        setattr(target, name, getattr(source, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(target, name, getattr(source, name))
    # track_running_stats too: BaseFinetuning sets it on the layer it sees (converted, while fitting).
    target.eps, target.momentum, target.track_running_stats = source.eps, source.momentum, source.track_running_stats
    for name, child in source._modules.items():
        target.add_module(name, child)
    # The flag only, as torch's converter does: `.train()` would recurse into the children.
    target.training = source.training
    # The registries themselves, shared: a hook registered on either layer (a forward hook logging activations)
    # runs on the one in the model, and the handle torch returned for it still removes it.
    for name in _HOOK_SLOTS:
        object.__setattr__(target, name, getattr(source, name))
    if hasattr(source, "qconfig"):  # keep quantisation configs, as torch's converter does
        target.qconfig = source.qconfig
