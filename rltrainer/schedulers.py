"""Learning-rate schedules by name, through transformers' ``get_scheduler`` (the names TRL and the
HF ``Trainer`` take as ``lr_scheduler_type``): ``"constant"``, ``"linear"``, ``"cosine"``,
``"cosine_with_min_lr"``, ``"polynomial"``, ...

A schedule steps once per optimizer step. One that decays needs the run's length: the Trainer sets
``module.estimated_optimizer_steps`` before setup (:func:`estimate_optimizer_steps`), so
``configure_optimizers`` on every rank reads the same value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rltrainer.values import check_int

#: Names that need no ``num_training_steps``; every other schedule decays over the run.
NO_HORIZON = frozenset({"constant", "constant_with_warmup", "inverse_sqrt"})
#: transformers names that cannot run here: a plateau schedule needs a metric at each step.
REFUSED = {"reduce_lr_on_plateau": "it steps on a validation metric, and schedules here step once per optimizer step"}


def check_lr_scheduler(name: str, warmup_steps: int) -> None:
    """Raise, at construction, for an unknown or unsupported schedule name or a bad warm-up."""
    from transformers import SchedulerType

    names = [s.value for s in SchedulerType if s.value not in REFUSED]
    if name in REFUSED:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported: {REFUSED[name]}. Choose one of {names}.")
    if name not in names:
        raise ValueError(f"Unknown lr_scheduler_type {name!r}; transformers' get_scheduler names: {names}.")
    check_int("warmup_steps", warmup_steps, at_least=0, meaning="optimizer steps of linear warm-up")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int,
                       total_steps: int | None, kwargs: Mapping[str, Any] | None = None) -> Any:
    """transformers' ``get_scheduler(name, optimizer, warmup_steps, total_steps, **kwargs)``; a
    ``"constant"`` schedule with warm-up is ``"constant_with_warmup"``. A decaying schedule without a
    known ``total_steps`` raises, saying how to give the run a length."""
    from transformers import get_scheduler

    if name == "constant" and warmup_steps:
        name = "constant_with_warmup"
    if name not in NO_HORIZON and not total_steps:
        raise ValueError(f"lr_scheduler_type={name!r} decays over the run, whose length is unknown (the train "
                         "dataloader has no len() and max_steps=-1). Set Trainer(max_steps=...), or use "
                         "lr_scheduler_type='constant'.")
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
                         scheduler_specific_kwargs=dict(kwargs or {}))


def estimate_optimizer_steps(training_steps: int | None, module: Any, prompts_per_step: int | None) -> int | None:
    """Optimizer steps of a run: ``training_steps x update_epochs x`` mini-batches per batch (a batch
    has ``prompts_per_step x G`` rows; ``mini_batch_size`` rows per optimizer step, default all of
    them). ``None`` when the run's length is unknown."""
    if training_steps is None:
        return None
    rows = prompts_per_step * max(getattr(module.sampling, "n", 1), 1) if prompts_per_step else None
    mini = getattr(module, "mini_batch_size", None)
    per_batch = math.ceil(rows / mini) if mini and rows else 1
    return training_steps * max(getattr(module, "update_epochs", 1), 1) * per_batch
