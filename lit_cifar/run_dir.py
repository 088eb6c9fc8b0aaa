"""Where a run lives: ``--trainer.default_root_dir`` moves the CLI's TensorBoard logger, as in plain Lightning.

Lightning's own default logger is ``TensorBoardLogger(save_dir=trainer.default_root_dir)``, and
everything a run writes follows the logger: the checkpoints (``<log_dir>/checkpoints``, unless a
``ModelCheckpoint`` has its own ``dirpath``), LightningCLI's ``config.yaml``, and the project's
``benchmark.json``, ``predictions.pt`` and fit summary, which all ask ``trainer.log_dir``.
``train.py`` configures its logger itself (``default_hp_metric=False``) and must give it a
``save_dir``: :data:`DEFAULT_SAVE_DIR`, the working directory. :func:`follow_default_root_dir`
replaces that default by ``default_root_dir`` when one is given; any other ``save_dir`` (a flag or a
config) is the user's and stays.
"""

from __future__ import annotations

from jsonargparse import Namespace

__all__ = ["DEFAULT_SAVE_DIR", "follow_default_root_dir"]

DEFAULT_SAVE_DIR = "."


def follow_default_root_dir(trainer: Namespace) -> None:
    """In the parsed ``trainer`` config: loggers left at ``save_dir=DEFAULT_SAVE_DIR`` save under
    ``default_root_dir`` (when set). Changed in place, so the saved ``config.yaml`` records the real folder."""
    root = trainer.get("default_root_dir")
    if root is None:
        return
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
        if isinstance(init_args, Namespace) and init_args.get("save_dir") == DEFAULT_SAVE_DIR:
            init_args.save_dir = str(root)
