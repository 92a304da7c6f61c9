"""Ctrl-C is a normal way to stop ``fit``: the first SIGINT lets the current step finish, then ``fit``
saves a checkpoint where ``ckpt_path="last"`` finds it, flushes the loggers and returns with
``trainer.interrupted`` set; a second SIGINT raises ``KeyboardInterrupt`` at once (and ``fit`` tears
down). The handler is installed only in the main thread (Python delivers signals there), for the
duration of the training loop, and the previous one is put back after it."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rltrainer.callbacks import ModelCheckpoint

if TYPE_CHECKING:
    from rltrainer.trainer import Trainer

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_on_interrupt(trainer: Trainer) -> Iterator[None]:
    """Within the block, a first SIGINT sets ``trainer.interrupted`` and ``trainer.should_stop`` (the
    loop ends after this step); a second raises ``KeyboardInterrupt``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if trainer.interrupted:
            raise KeyboardInterrupt
        trainer.interrupted = trainer.should_stop = True
        log.warning("Interrupted: stopping after the current step, with a checkpoint (press Ctrl-C again to "
                    "stop at once, without one)")

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def save_interrupted(trainer: Trainer) -> Path:
    """After an interrupted loop: save ``step=<global_step>.ckpt`` through the trainer's
    :class:`ModelCheckpoint` (or one with the default directory), log how to resume, return the path."""
    callback = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if callback is None:  # no periodic checkpoints: write one where ckpt_path="last" looks
        callback = ModelCheckpoint()
        callback.on_fit_start(trainer, trainer.module)
    path = callback.save(trainer)
    trainer.wait_for_checkpoint()
    log.warning("Interrupted after step %d: saved %s. To resume, call fit(..., ckpt_path='last') "
                "(command line: the same command with --ckpt_path last).", trainer.global_step, path)
    return path
