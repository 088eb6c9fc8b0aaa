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

from pathlib import Path

from jsonargparse import Namespace

__all__ = ["DEFAULT_SAVE_DIR", "follow_default_root_dir", "resume_last_version"]

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


def _last_checkpoints(save_dir: str, name: str) -> list[Path]:
    return list(Path(save_dir, name).glob("version_*/checkpoints/last*.ckpt"))


def resume_last_version(trainer: Namespace, ckpt_path: object) -> str | None:
    """For ``fit --ckpt_path=last``: pin the TensorBoard logger to the version folder holding the newest
    ``last*.ckpt``, so Lightning's ``"last"`` lookup (in that logger's ``checkpoints/``) finds it and the
    logs go on in the same folder. Returns the pinned version, ``None`` when there is nothing to resume
    (the first run of a job starts fresh: Lightning warns and loads nothing) or the version was chosen."""
    if ckpt_path != "last":
        return None
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
        if not isinstance(init_args, Namespace) or init_args.get("version") is not None:
            continue
        found = _last_checkpoints(
            str(init_args.get("save_dir") or DEFAULT_SAVE_DIR), str(init_args.get("name") or "lightning_logs")
        )
        if found:
            init_args.version = max(found, key=lambda path: path.stat().st_mtime).parents[1].name
            return init_args.version
    return None
