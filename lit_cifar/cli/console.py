"""Console hygiene: Lightning's advertising tips and two known non-actionable warnings, dropped at their source.

Lightning 2.6 prints two "💡 Tip" lines through ``rank_zero_info`` on every run: one about
``litlogger`` whenever no ``LitLogger`` is among the loggers (``_LoggerConnector.configure_logger``:
no setting or environment variable turns it off), one about ``litmodels`` whenever the Trainer
creates its default ``ModelCheckpoint`` (``_CallbackConnector._configure_checkpoint_callbacks``;
a config that lists its own ``ModelCheckpoint`` never sees it). Both are INFO records of the
``lightning.pytorch.utilities.rank_zero`` logger (``lightning.fabric...`` when Fabric's module
set it). :func:`quiet_lightning_tips` adds a logging filter that drops exactly those records;
every other Lightning message (devices, distributed setup, "`Trainer.fit` stopped") still prints.

Two warnings are ignored, each matched by message, category AND the module that reports it, so the
same words from anywhere else still print:

- :func:`quiet_leafspec_deprecation`: Lightning 2.6's ``utilities/_pytree.py`` builds a torch
  ``LeafSpec()`` (every ``CombinedLoader``: each fit, validate, test, predict), which torch 2.14
  deprecates with a ``FutureWarning``, once per process. Nothing in the user's code or config can
  change it; a newer Lightning will.
- :func:`quiet_checkpoint_dirpath_warning`, for test / predict / validate only: with ``ckpt_path``,
  Lightning restores every callback's state, and a ``ModelCheckpoint`` warns on every rank that its
  ``dirpath`` (this run's new ``version_N/checkpoints``) differs from the fit's, so it keeps only
  ``best_model_path``. Outside fit a ``ModelCheckpoint`` saves nothing: the state it drops is never
  used. Dropping the callback is no cure: Lightning then warns that the checkpoint's callbacks
  "need to be provided". When resuming a fit the warning matters and still prints.
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["TIP_PREFIX", "quiet_checkpoint_dirpath_warning", "quiet_leafspec_deprecation", "quiet_lightning_tips"]

TIP_PREFIX = "💡 Tip:"
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


_FILTER = _DropTips()


def quiet_lightning_tips() -> None:
    """Drop Lightning's "💡 Tip" log lines in this process (idempotent)."""
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _ignore(message: str, category: type[Warning], module: str) -> None:
    """Ignore warnings that start with ``message``, of ``category``, reported from exactly ``module``."""
    warnings.filterwarnings("ignore", message=re.escape(message), category=category, module=re.escape(module) + "$")


def quiet_leafspec_deprecation() -> None:
    """Ignore torch's LeafSpec deprecation raised by Lightning's ``_pytree`` module, in this process."""
    _ignore("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "lightning.pytorch.utilities._pytree")


def quiet_checkpoint_dirpath_warning() -> None:
    """Ignore ModelCheckpoint's "The dirpath has changed" in this process: call it only outside fit."""
    _ignore("The dirpath has changed from", UserWarning, "lightning.pytorch.callbacks.model_checkpoint")
