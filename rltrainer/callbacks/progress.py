"""A tqdm progress bar with the step, the mean reward and the step time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rltrainer.callbacks.callback import Callback

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer


class ProgressBar(Callback):
    """Shows ``step``, ``reward`` (``critic/score/mean``) and ``step_s`` (``timing_s/step``)."""

    def __init__(self, leave: bool = True) -> None:
        self.leave = leave
        self._bar: Any = None

    def on_fit_start(self, trainer: Trainer, module: RLModule) -> None:
        from tqdm.auto import tqdm

        total = trainer.estimated_total_steps
        self._bar = tqdm(total=total, initial=trainer.global_step, desc="fit", unit="step", leave=self.leave,
                         dynamic_ncols=True)

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
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_exception(self, trainer: Trainer, module: RLModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, module)
