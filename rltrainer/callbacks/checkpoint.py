"""Periodic checkpoints: ``ModelCheckpoint(every_n_steps=50)`` writes ``step=N.ckpt`` and
``last.ckpt`` under ``<default_root_dir>/checkpoints``; ``fit(ckpt_path="last")`` resumes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rltrainer.callbacks.callback import Callback

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer


class ModelCheckpoint(Callback):
    """Save every ``every_n_steps`` steps and at the end of fit; keep the newest ``save_top_k``."""

    def __init__(self, dirpath: str | Path | None = None, every_n_steps: int = 100, save_last: bool = True,
                 keep: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.dirpath = Path(dirpath) if dirpath else None
        self.every_n_steps, self.save_last, self.keep = every_n_steps, save_last, keep
        self._saved: list[Path] = []

    def _dir(self, trainer: Trainer) -> Path:
        return self.dirpath or Path(trainer.default_root_dir) / "checkpoints"

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._save(trainer)

    def on_fit_end(self, trainer: Trainer, module: RLModule) -> None:
        if self.save_last and trainer.global_step % self.every_n_steps != 0:
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        path = self._dir(trainer) / f"step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self._saved.append(path)
        while len(self._saved) > self.keep:
            self._saved.pop(0).unlink(missing_ok=True)
        if self.save_last:
            last = self._dir(trainer) / "last.ckpt"
            last.unlink(missing_ok=True)
            last.symlink_to(path.name)
