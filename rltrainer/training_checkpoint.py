"""The Trainer's checkpoint, written and read: the strategy's training state under ``training/``
and the controller's counters, RNG, data position, pipeline buffers, loggers and callbacks' entries
in ``trainer.pt`` (the format: :mod:`rltrainer.checkpoints`). Functions take what they use; the
Trainer gathers its state and applies what :func:`load_checkpoint` returns."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltrainer.checkpoints import (FORMAT, MANIFEST, TRAINER_FILE, TRAINING_DIR, VERSION, CheckpointError,
                                   commit_directory, controller_rng_state, load_training, save_file, seal,
                                   set_controller_rng_state, temporary_directory)


@dataclass
class PendingCheckpoint:
    """A checkpoint written under a temporary name whose ranks may still be writing (an async save)."""

    tmp: Path
    path: Path
    on_saved: Callable[[Path], None] | None

    def complete(self, strategy: Any) -> None:
        """Wait for the ranks' writes, list every file's sha256 (``checksums.json``), rename it onto
        ``path`` (it becomes visible), then call ``on_saved(path)``."""
        try:
            seal(self.tmp, strategy)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        commit_directory(self.tmp, self.path)
        if self.on_saved is not None:
            self.on_saved(self.path)


def write_checkpoint(path: str | Path, strategy: Any, state: dict[str, Any], on_save: Callable[[dict[str, Any]], None],
                     async_save: bool = False, on_saved: Callable[[Path], None] | None = None) -> PendingCheckpoint:
    """Write the strategy's training state and ``state`` (the controller's counters: ``pipeline``,
    ``global_step``, ``current_epoch``, ``batches_seen_in_epoch``, ``loggers``) under a temporary name
    beside ``path``; ``on_save(checkpoint)`` adds the callbacks' entries. Returns it pending: complete
    it (:meth:`PendingCheckpoint.complete`) once the ranks' writes are done."""
    path = Path(path)
    tmp = temporary_directory(path)
    try:
        (tmp / TRAINING_DIR).mkdir()
        strategy_state = strategy.save_checkpoint(tmp / TRAINING_DIR, async_save=async_save)
        checkpoint = {"format": FORMAT, "version": VERSION, "strategy_class": type(strategy).__name__,
                      "strategy": strategy_state, **state, "rng": controller_rng_state(), "checksums": MANIFEST}
        on_save(checkpoint)
        save_file(checkpoint, tmp / TRAINER_FILE, "the trainer state")
    except BaseException:
        with contextlib.suppress(Exception):
            strategy.wait_checkpoint()  # nothing writes into it any more
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PendingCheckpoint(tmp, path, on_saved)


def load_checkpoint(path: Path, checkpoint: dict[str, Any], strategy: Any, pipeline_mode: str) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (``checkpoint``: its ``trainer.pt``, read by
    :func:`~rltrainer.checkpoints.read_trainer_state`) into ``strategy`` (its files checked against
    ``checksums.json`` first) and set the controller's RNG; return the pipeline's buffers to restore
    (its ``pipeline`` entry without the ``mode``). Raises if it was written with another pipeline
    mode than ``pipeline_mode``."""
    pipeline = dict(checkpoint["pipeline"])
    if pipeline.pop("mode", pipeline_mode) != pipeline_mode and pipeline:
        raise ValueError(f"The checkpoint was written with pipeline={checkpoint['pipeline']['mode']!r}; "
                         f"resume it with the same pipeline (this Trainer has {pipeline_mode!r})")
    try:
        load_training(strategy, path, checkpoint["strategy"])  # checked against checksums.json first
    except CheckpointError as exc:
        if str(path) in str(exc) or str(path.resolve()) in str(exc):
            raise
        raise CheckpointError(f"{path}: {exc}") from exc
    set_controller_rng_state(checkpoint["rng"])
    return pipeline
