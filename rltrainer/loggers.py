"""Loggers are Lightning's, resolved by name and imported lazily (``import lightning`` takes
several seconds, so it happens only when a logger is actually used)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: name -> (module, class). All take ``save_dir``/``name`` or their own arguments.
LOGGER_NAMES = {
    "csv": ("lightning.pytorch.loggers", "CSVLogger"),
    "tensorboard": ("lightning.pytorch.loggers", "TensorBoardLogger"),
    "wandb": ("lightning.pytorch.loggers", "WandbLogger"),
    "mlflow": ("lightning.pytorch.loggers", "MLFlowLogger"),
}


def build_loggers(logger: Any, default_root_dir: str | Path) -> list[Any]:
    """``True`` -> CSVLogger; ``False``/``None`` -> none; a name (``"csv"``, ``"tensorboard"``,
    ``"wandb"``, ``"mlflow"``); a logger instance; or a list of those."""
    if logger is None or logger is False:
        return []
    if logger is True:
        logger = "csv"
    items = logger if isinstance(logger, (list, tuple)) else [logger]
    return [_build_one(item, default_root_dir) for item in items]


def _build_one(item: Any, root: str | Path) -> Any:
    if not isinstance(item, str):
        if not hasattr(item, "log_metrics"):
            raise TypeError(f"A logger needs a log_metrics(metrics, step) method; got {type(item).__name__}")
        return item
    if item not in LOGGER_NAMES:
        raise ValueError(f"Unknown logger {item!r}. Available logger names: {', '.join(sorted(LOGGER_NAMES))}.")
    import importlib

    module_name, class_name = LOGGER_NAMES[item]
    cls = getattr(importlib.import_module(module_name), class_name)
    if item in ("csv", "tensorboard"):
        return cls(save_dir=str(root), name="lightning_logs")
    return cls()
