"""Console hygiene: Lightning's advertising tips, dropped through Python's logging API.

Lightning 2.6 prints two "💡 Tip" lines through ``rank_zero_info`` on every run: one about
``litlogger`` whenever no ``LitLogger`` is among the loggers (``_LoggerConnector.configure_logger``:
no setting or environment variable turns it off), one about ``litmodels`` whenever the Trainer
creates its default ``ModelCheckpoint`` (``_CallbackConnector._configure_checkpoint_callbacks``;
a config that lists its own ``ModelCheckpoint`` never sees it). Both are INFO records of the
``lightning.pytorch.utilities.rank_zero`` logger (``lightning.fabric...`` when Fabric's module
set it). :func:`quiet_lightning_tips` adds a logging filter that drops exactly those records;
every other Lightning message (devices, distributed setup, "`Trainer.fit` stopped") still prints.
"""

from __future__ import annotations

import logging

__all__ = ["TIP_PREFIX", "quiet_lightning_tips"]

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
