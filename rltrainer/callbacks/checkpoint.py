"""Periodic checkpoints: ``ModelCheckpoint(every_n_steps=50)`` writes the checkpoint directories
``step=N.ckpt`` and the symlink ``last.ckpt`` under ``dirpath`` (default
``<default_root_dir>/checkpoints``); ``fit(ckpt_path="last")`` resumes from there. Each appears only
once complete, and ``last`` moves in one rename (:mod:`rltrainer.checkpoints`).

A run never replaces another run's checkpoints: one that resumes from a run's newest checkpoint goes
on in its directory; one that starts from scratch (or from an older checkpoint) where ``dirpath``
already holds checkpoints writes to ``<dirpath>-2`` (``-3``...) instead, and says so.
``ckpt_path="last"`` takes the newest of them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rltrainer.callbacks.callback import Callback
from rltrainer.checkpoints import (CheckpointError, clean_leftovers, dangling_last, find_last, find_last_run,
                                   fresh_run_directory, is_complete, point_last, remove_checkpoint, run_directories,
                                   step_checkpoints)

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer

log = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """Save every ``every_n_steps`` steps and at the end of fit; keep the newest ``keep``.

    Args:
        dirpath: where checkpoints go (default ``<default_root_dir>/checkpoints``); ``fit(ckpt_path="last")``
            looks here (and in the ``<dirpath>-N`` of runs started beside it).
        every_n_steps: save after every N-th step.
        save_last: keep ``last.ckpt`` pointing at the newest checkpoint, and save at the end of fit.
        keep: how many ``step=N.ckpt`` of this run to keep (the oldest are deleted once a newer one is
            complete; a resumed run goes on pruning those it wrote before; another run's are never
            deleted).
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
        self._run_dir: Path | None = None  # during and after fit: where this run writes
        self._saved_step: int | None = None

    def checkpoint_dir(self, trainer: Trainer) -> Path:
        """Where ``fit(ckpt_path="last")`` looks (with the runs beside it), and a first run writes."""
        return self.dirpath or Path(trainer.default_root_dir) / "checkpoints"

    def run_dir(self, trainer: Trainer) -> Path:
        """Where this run writes: :meth:`checkpoint_dir`, unless it holds another run's checkpoints."""
        return self._run_dir or self.checkpoint_dir(trainer)

    def on_fit_start(self, trainer: Trainer, module: RLModule) -> None:
        base, resumed = self.checkpoint_dir(trainer), trainer.ckpt_path
        for directory in run_directories(base):  # deletions a crash interrupted: already decided
            clean_leftovers(directory)
        newest = {last.resolve(): d for d in run_directories(base) if (last := find_last(d)) is not None}
        if resumed is not None and resumed.resolve() in newest:  # a run's newest: it goes on where it was
            self._run_dir, self._saved_step = newest[resumed.resolve()], trainer.global_step
            self._saved = self._written_before(self._run_dir)
        elif resumed is None and self._run_dir is not None:
            return  # fit() again in this process: the same run
        else:
            self._run_dir, self._saved, self._saved_step = fresh_run_directory(base), [], None
            if self._run_dir != base:
                log.warning("%s holds the checkpoints of an earlier run; this run starts %s and writes its "
                            "checkpoints to %s beside them, which stay as they are. To resume the newest run "
                            "instead, pass ckpt_path='last' (command line: --ckpt_path last).", base,
                            f"from {resumed}" if resumed else "from scratch", self._run_dir)

    @staticmethod
    def _written_before(run_dir: Path) -> list[Path]:
        """The checkpoints of the run in ``run_dir`` (it resumes), oldest first, to prune as it goes on;
        those left incomplete (a crash mid-save or mid-delete of an older rltrainer) are removed."""
        clean_leftovers(run_dir, temporary=True)
        saved = []
        for _, path in step_checkpoints(run_dir):
            if is_complete(path):
                saved.append(path)
            else:
                log.info("Removing %s: an incomplete checkpoint (a save or deletion that did not finish)", path)
                remove_checkpoint(path)
        return saved

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.save(trainer)

    def on_fit_end(self, trainer: Trainer, module: RLModule) -> None:
        if self.save_last:
            self.save(trainer)

    def save(self, trainer: Trainer) -> Path:
        """Save ``step=<global_step>.ckpt`` in this run's directory (once per step) and return it."""
        path = self.run_dir(trainer) / f"step={trainer.global_step}.ckpt"
        if self._saved_step != trainer.global_step:
            self._saved_step = trainer.global_step
            trainer.save_checkpoint(path, async_save=self.async_save, on_saved=self._on_saved)
        return path

    def _on_saved(self, path: Path) -> None:
        """``path`` is complete: point ``last`` at it, then delete the oldest beyond ``keep``."""
        if path not in self._saved:
            self._saved.append(path)
        if self.save_last:
            point_last(path.parent, path)  # before deleting: last never points at a removed checkpoint
        while len(self._saved) > self.keep:
            remove_checkpoint(self._saved.pop(0))


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | Path) -> Path | None:
    """``fit(ckpt_path=...)``: ``"last"`` is the newest checkpoint in the checkpoint directory (a
    ``ModelCheckpoint``'s, else ``<default_root_dir>/checkpoints``) or beside it, or ``None`` (with a
    warning) on a fresh run, which then starts from scratch; any other value is a path. A ``last.ckpt``
    that points to a deleted checkpoint raises :class:`~rltrainer.checkpoints.CheckpointError`
    (``ckpt_path=None`` starts fresh)."""
    if str(ckpt_path) != "last":
        return Path(ckpt_path)
    dirs = [c.checkpoint_dir(trainer) for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    dirs = dirs or [Path(trainer.default_root_dir) / "checkpoints"]
    for directory in (d for base in dirs for d in run_directories(base)):
        if (target := dangling_last(directory)) is not None:
            older = find_last(directory)  # the newest step=N.ckpt left, if any
            raise CheckpointError(
                f"ckpt_path='last': {directory / 'last.ckpt'} points to {target}, which does not exist (deleted?), "
                f"so what to resume is unknown. "
                + (f"Pass the checkpoint to resume, e.g. the newest left there: ckpt_path={str(older)!r}, "
                   if older is not None else "No checkpoint is left there: ")
                + "or start fresh with ckpt_path=None (command line: leave out --ckpt_path).")
    found = [p for p in map(find_last_run, dirs) if p is not None]
    if not found:
        log.warning("ckpt_path='last': no checkpoint in %s yet; training starts from scratch",
                    ", ".join(str(d) for d in dirs))
        return None
    return found[0]
