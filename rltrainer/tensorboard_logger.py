"""The TensorBoard logger that ``logger="tensorboard"`` builds: Lightning's ``TensorBoardLogger`` whose
full disk is the :class:`~rltrainer.checkpoints.DiskFullError` the CSV logger raises, naming the events
file, instead of Lightning's ``ValueError: you tried to log 0.56 which is currently not supported``.

TensorBoard writes its events in a thread of its own; a write that fails there (``No space left on
device``) is raised again by the next ``add_scalar`` or ``flush``, which Lightning's ``log_metrics``
reports as a value it cannot log. Every write here goes through
:func:`~rltrainer.files.reporting_disk_full`, which follows the error's causes to the full disk.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

from rltrainer.files import reporting_disk_full


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` (same arguments) whose writes raise ``DiskFullError`` on a full disk."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        with self._writing(f"{len(metrics)} metrics of step {step}"):
            super().log_metrics(metrics, step)

    def log_hyperparams(self, params: Any, metrics: Any = None) -> None:
        with self._writing("the hyperparameters"):
            super().log_hyperparams(params, metrics)

    def save(self) -> None:
        with self._writing("the events it holds (flush)"):
            super().save()

    def finalize(self, status: str) -> None:
        with self._writing("the last events (close)"):
            super().finalize(status)

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        directory = Path(self.log_dir)
        events = sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime) \
            if directory.is_dir() else []
        with reporting_disk_full(events[-1] if events else directory, f"TensorBoard's events: {what}"):
            yield
