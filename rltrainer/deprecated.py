"""The Trainer's former spellings, kept working for now: keywords that moved to their owners
(the pipeline object, the Strategy, the :class:`~rltrainer.LogGenerations` callback, the
:class:`~rltrainer.loggers.Logger` spec) and module-facing helpers that left its public surface.
Each use warns once with a ``DeprecationWarning`` that shows the new spelling."""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rltrainer.data.batch import RolloutBatch

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.weights.sync import WeightSync

#: Trainer keyword -> (its new home, how to spell it there).
MOVED: dict[str, tuple[str, str]] = {
    "weight_sync": ("pipeline", "pipeline=SyncPipeline(push_mode='wait' | 'background')"),
    "max_staleness": ("pipeline", "pipeline=AsyncPipeline(max_staleness=...)"),
    "staleness_policy": ("pipeline", "pipeline=AsyncPipeline(staleness_policy=...)"),
    "micro_batch_size": ("strategy", "strategy=SingleDeviceStrategy(micro_batch_size=...) (or FSDP2Strategy(...))"),
    "max_tokens_per_micro_batch": ("strategy", "strategy=FSDP2Strategy(max_tokens_per_micro_batch=...)"),
    "padding_free": ("strategy", "strategy=FSDP2Strategy(padding_free=...)"),
    "log_generations_every_n_steps": ("generations", "callbacks=[LogGenerations(every_n_steps=...)]"),
    "log_generations_rows": ("generations", "callbacks=[LogGenerations(rows=...)]"),
    "project": ("logger", "logger=Logger('wandb', project=...)"),
    "run_name": ("logger", "logger=Logger('wandb', run_name=...)"),
    "run_id": ("logger", "logger=Logger('wandb', run_id=...)"),
}
#: The keyword each home's constructor takes for a moved Trainer keyword (where it differs).
RENAMED = {"log_generations_every_n_steps": "every_n_steps", "log_generations_rows": "rows"}


def moved_arguments(kwargs: Mapping[str, Any], owner: Callable[..., Any]) -> dict[str, dict[str, Any]]:
    """``Trainer(**kwargs)``'s moved keywords grouped by their new home (``pipeline``, ``strategy``,
    ``generations``, ``logger``), named as there; warns once for all of them. An unknown keyword
    raises ``TypeError`` naming it and the closest of ``owner``'s parameters (or the moved ones)."""
    unknown = [k for k in kwargs if k not in MOVED]
    if unknown:
        named = inspect.signature(owner).parameters.values()
        options = [p.name for p in named if p.kind is not p.VAR_KEYWORD] + list(MOVED)
        close = difflib.get_close_matches(unknown[0], options, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(options)}"
        raise TypeError(f"Trainer() got an unexpected keyword argument {unknown[0]!r}{hint}")
    homes: dict[str, dict[str, Any]] = {"pipeline": {}, "strategy": {}, "generations": {}, "logger": {}}
    for name, value in kwargs.items():
        homes[MOVED[name][0]][RENAMED.get(name, name)] = value
    if kwargs:
        spelled = "; ".join(f"{name}= -> {MOVED[name][1]}" for name in kwargs)
        warnings.warn(f"Trainer({', '.join(kwargs)}) moved to where each setting lives: {spelled}. The old "
                      "keywords still work for now and will be removed.", DeprecationWarning, stacklevel=3)
    return homes


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)


class DeprecatedTrainerMethods:
    """Module-facing helpers that were public Trainer methods, as thin aliases of their new homes."""

    module: RLModule | None
    sync: WeightSync | None
    global_step: int

    def sync_weights(self) -> dict[str, float]:
        """Deprecated: ``trainer.sync.push(trainer.global_step, mode="wait")``."""
        _warn("Trainer.sync_weights()", 'trainer.sync.push(trainer.global_step, mode="wait")')
        if self.sync is None:
            raise RuntimeError("Trainer.sync_weights() needs a set-up trainer (inside or after fit/validate)")
        return self.sync.push(self.global_step, mode="wait")

    def as_batch(self, raw: Any) -> RolloutBatch:
        """Deprecated: ``RolloutBatch.from_loader(raw)``."""
        _warn("Trainer.as_batch(raw)", "RolloutBatch.from_loader(raw)")
        return RolloutBatch.from_loader(raw)

    def draw_prompts(self) -> RolloutBatch | None:
        """Deprecated: ``self.draw_prompts()`` in the module's ``rollout_step``."""
        _warn("Trainer.draw_prompts()", "self.draw_prompts() in the module (RLModule.draw_prompts)")
        if self.module is None:
            raise RuntimeError("Trainer.draw_prompts() is only available inside fit(), from rollout_step")
        return self.module.draw_prompts()

    def record_generations(self, batch: RolloutBatch, split: str) -> None:
        """Deprecated: ``self.record_generations(batch, split)`` in the module."""
        _warn("Trainer.record_generations(batch, split)", "self.record_generations(batch, split) in the module")
        if self.module is not None:
            self.module.record_generations(batch, split)
