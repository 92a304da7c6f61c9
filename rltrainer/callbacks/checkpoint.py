"""Periodic checkpoints: ``ModelCheckpoint(every_n_steps=50)`` writes the checkpoint directories
``step=N.ckpt`` and the symlink ``last.ckpt`` under ``dirpath`` (default
``<default_root_dir>/checkpoints``); ``fit(ckpt_path="last")`` resumes from there. Each appears only
once complete, and ``last`` moves in one rename (:mod:`rltrainer.checkpoints`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rltrainer.callbacks.callback import Callback
from rltrainer.checkpoints import point_last, remove_checkpoint

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save every ``every_n_steps`` steps and at the end of fit; keep the newest ``keep``.

    Args:
        dirpath: where checkpoints go (default ``<default_root_dir>/checkpoints``); ``fit(ckpt_path="last")``
            looks here.
        every_n_steps: save after every N-th step.
        save_last: keep ``last.ckpt`` pointing at the newest checkpoint, and save at the end of fit.
        keep: how many ``step=N.ckpt`` to keep (the oldest are deleted once a newer one is complete).
        async_save: write in the background while training goes on (``fsdp2``; see
            :meth:`Trainer.save_checkpoint`): the checkpoint, ``last`` and the deletions follow when it
            is complete, at the next save or the end of fit.
    """

    def __init__(self, dirpath: str | Path | None = None, every_n_steps: int = 100, save_last: bool = True,
                 keep: int = 1, async_save: bool = False) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (how many step=N.ckpt to keep), got {keep}")
        self.dirpath = Path(dirpath) if dirpath else None
        self.every_n_steps, self.save_last, self.keep, self.async_save = every_n_steps, save_last, keep, async_save
        self._saved: list[Path] = []

    def checkpoint_dir(self, trainer: Trainer) -> Path:
        """Where this callback writes (and ``fit(ckpt_path="last")`` looks)."""
        return self.dirpath or Path(trainer.default_root_dir) / "checkpoints"

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_fit_end(self, trainer: Trainer, module: RLModule) -> None:
        if self.save_last and trainer.global_step % self.every_n_steps != 0:
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        directory = self.checkpoint_dir(trainer)
        path = directory / f"step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path, async_save=self.async_save, on_saved=self._on_saved)

    def _on_saved(self, path: Path) -> None:
        """``path`` is complete: point ``last`` at it, then delete the oldest beyond ``keep``."""
        if path not in self._saved:
            self._saved.append(path)
        if self.save_last:
            point_last(path.parent, path)  # before deleting: last never points at a removed checkpoint
        while len(self._saved) > self.keep:
            remove_checkpoint(self._saved.pop(0))
