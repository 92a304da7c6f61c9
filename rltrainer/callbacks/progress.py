"""A tqdm progress bar with the step, the mean reward and the step time; while it shows, what is logged
to the console goes above it, on lines of its own (:func:`logs_above_the_bar`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rltrainer.callbacks.callback import Callback

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer


@contextlib.contextmanager
def logs_above_the_bar(tqdm_class: Any) -> Iterator[None]:
    """The root logger's console handlers write through ``tqdm.write`` (a warning would otherwise
    be printed inside the bar's line, after its last update); with no handler configured at all,
    what Python's last resort would print (WARNING and up) is written so too."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    added = None
    if not logging.getLogger("rltrainer").hasHandlers():  # nothing configured: logging's last resort
        added = logging.StreamHandler()
        added.setLevel(logging.WARNING)
        logging.root.addHandler(added)
    try:
        with logging_redirect_tqdm(tqdm_class=tqdm_class):
            if added is not None:
                logging.root.handlers[-1].setLevel(logging.WARNING)
            yield
    finally:
        if added is not None:
            logging.root.removeHandler(added)


class ProgressBar(Callback):
    """Shows ``step``, ``reward`` (``critic/score/mean``) and ``step_s`` (``timing_s/step``)."""

    def __init__(self, leave: bool = True) -> None:
        self.leave = leave
        self._bar: Any = None
        self._logs: contextlib.ExitStack | None = None  # during fit: the console logs' redirection

    def on_fit_start(self, trainer: Trainer, module: RLModule) -> None:
        from tqdm.auto import tqdm

        total = trainer.estimated_total_steps
        self._bar = tqdm(total=total, initial=trainer.global_step, desc="fit", unit="step", leave=self.leave,
                         dynamic_ncols=True)
        self._logs = contextlib.ExitStack()
        self._logs.enter_context(logs_above_the_bar(type(self._bar)))

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        postfix = {"reward": metrics.get("critic/score/mean"), "step_s": metrics.get("timing_s/step")}
        self._bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items() if v is not None}, refresh=False)

    def on_validation_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        if self._bar is not None and "val/score" in metrics:
            self._bar.write(f"step {trainer.global_step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))

    def on_fit_end(self, trainer: Trainer, module: RLModule) -> None:
        if self._logs is not None:
            self._logs.close()
            self._logs = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_exception(self, trainer: Trainer, module: RLModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, module)
