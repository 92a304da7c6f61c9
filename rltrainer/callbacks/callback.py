"""Callbacks: controller-side hooks at the points of ``fit()``; the same events as the module's
lifecycle hooks, with the trainer and module passed in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rltrainer.data.batch import RolloutBatch
    from rltrainer.module import RLModule
    from rltrainer.trainer import Trainer


class Callback:
    """Override any of these; all run on the controller, after the module's hook of that name."""

    def on_fit_start(self, trainer: Trainer, module: RLModule) -> None:
        """After setup (models built, engine synced), before the first step."""

    def on_fit_end(self, trainer: Trainer, module: RLModule) -> None:
        """After the last step (and the final validation)."""

    def on_step_start(self, trainer: Trainer, module: RLModule, batch: RolloutBatch) -> None:
        """At the start of each step, with its prompt batch (``B`` prompt rows), before its
        ``reward_step``; in ``pipeline="sync"`` before their ``rollout_step`` too (see
        :meth:`rltrainer.RLModule.on_step_start`)."""

    def on_step_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        """After the weight sync, with the step's metrics. Set ``trainer.should_stop = True`` here to end
        ``fit()`` after this step."""

    def on_validation_start(self, trainer: Trainer, module: RLModule) -> None:
        """Before the first validation batch."""

    def on_validation_end(self, trainer: Trainer, module: RLModule, metrics: dict[str, float]) -> None:
        """With the aggregated validation metrics."""

    def on_save_checkpoint(self, trainer: Trainer, module: RLModule, checkpoint: dict[str, Any]) -> None:
        """Before a checkpoint is written; add entries to ``checkpoint`` to save them."""

    def on_load_checkpoint(self, trainer: Trainer, module: RLModule, checkpoint: dict[str, Any]) -> None:
        """After a checkpoint is read, before training resumes."""

    def on_exception(self, trainer: Trainer, module: RLModule, exception: BaseException) -> None:
        """When ``fit()`` fails, before the exception propagates."""
