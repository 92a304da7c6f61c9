"""Callbacks: controller-side hooks at the points of ``fit()`` (:class:`Callback`), and the default ones."""

from __future__ import annotations

from rltrainer.callbacks.callback import Callback
from rltrainer.callbacks.checkpoint import ModelCheckpoint
from rltrainer.callbacks.learning_signal import LearningSignal
from rltrainer.callbacks.progress import ProgressBar
from rltrainer.generations import LogGenerations

__all__ = ["Callback", "LearningSignal", "LogGenerations", "ModelCheckpoint", "ProgressBar", "with_defaults"]


def with_defaults(callbacks: list[Callback], progress_bar: bool = True) -> list[Callback]:
    """``callbacks`` plus the default ones not given: ``ProgressBar`` (with ``progress_bar``),
    ``LearningSignal`` and ``LogGenerations``, first, so that a step's sample rows are written before
    the other callbacks' ``on_step_end``."""
    defaults = [ProgressBar] * bool(progress_bar) + [LearningSignal]
    callbacks = callbacks + [cls() for cls in defaults if not any(isinstance(c, cls) for c in callbacks)]
    if not any(isinstance(c, LogGenerations) for c in callbacks):
        return [LogGenerations(), *callbacks]
    return callbacks
