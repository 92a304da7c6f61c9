"""The run plan: what one training step does, in rows, computed and checked at the start of
``fit`` before any model is built, then logged once (a table) and sent to every logger as
hyperparameters.

One unit throughout: a *row* is one sampled response (``N = B * G`` rows per step)::

    prompts per step (B)                    32
    samples per prompt (G)                   8
    rows per step (N = B*G)                256
    rows per optimizer step                 64
    optimizer steps per training step        4
    micro-batch                        64 rows
    ...

followed by what the engine says of its costs on this machine, if anything (vLLM on CPU: its
start-up, and the model size from which it generates faster than ``hf``;
:meth:`~rltrainer.rollout.engine.RolloutEngine.plan_notes`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

from rltrainer.values import check_int

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.rollout.engine import RolloutEngine
    from rltrainer.rollout.rollout import Rollout
    from rltrainer.strategies.strategy import Strategy

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The shape of a run. ``None`` where the loader or the settings do not say (a loader without
    ``batch_size`` or ``len``, ``max_steps=-1`` with an endless loader)."""

    prompts_per_step: int | None
    samples_per_prompt: int
    rows_per_step: int | None
    rows_per_optimizer_step: int | None
    optimizer_steps_per_training_step: int | None
    micro_batch: str
    training_ranks: int
    engine_replicas: int
    total_training_steps: int | None
    total_samples: int | None
    max_new_tokens: int | None
    max_generated_tokens_per_step: int | None
    notes: tuple[str, ...] = ()  # the engine's costs on this machine (RolloutEngine.plan_notes)

    def as_dict(self) -> dict[str, Any]:
        """``plan/<field>``: the plan as flat hyperparameters (``None`` fields and the notes left out)."""
        return {f"plan/{k}": v for k, v in dataclasses.asdict(self).items() if v is not None and k != "notes"}

    def table(self) -> str:
        """The plan as an aligned two-column text table, one line per field, then the notes."""
        labels = {"prompts_per_step": "prompts per step (B)", "samples_per_prompt": "samples per prompt (G)",
                  "rows_per_step": "rows per step (N = B*G)"}
        lines = [(labels.get(k, k.replace("_", " ")), "?" if v is None else f"{v:,}" if isinstance(v, int) else v)
                 for k, v in dataclasses.asdict(self).items() if k != "notes"]
        width = max(len(label) for label, _ in lines)
        return "\n".join([f"  {label:<{width}}  {value:>12}" for label, value in lines]
                         + [f"  note: {note}" for note in self.notes])


def build_plan(module: RLModule, strategy: Strategy, loader: Any, total_steps: int | None,
               rollout: Rollout | RolloutEngine | None = None) -> RunPlan:
    """The plan of ``fit(module, loader)`` under ``strategy`` and ``rollout`` (a
    :class:`~rltrainer.rollout.rollout.Rollout`, whose placement and replicas it counts, or an engine
    alone: colocated; with the engine's notes); raises
    :class:`ValueError` with the numbers if the batch cannot be split into mini-batches evenly (see
    :func:`check_plan`)."""
    B = getattr(loader, "batch_size", None)
    G = module.sampling.n
    N = B * G if isinstance(B, int) else None
    mini = module.mini_batch_size or N
    check_plan(B, G, module.mini_batch_size, module.update_epochs)
    max_new = module.sampling.max_new_tokens
    budget = getattr(strategy, "max_tokens_per_micro_batch", None)
    rows = getattr(strategy, "micro_batch_size", None)
    micro = f"{budget:,} tokens" if budget else f"{rows} rows" if rows else "?"
    if getattr(strategy, "padding_free", False):
        micro += ", packed"
    ranks = strategy.world_size
    engine = getattr(rollout, "engine", rollout)  # a Rollout's, or the engine given
    placement = getattr(rollout, "placement", "colocated")
    replicas = getattr(rollout, "replicas", 1) if placement == "split" else ranks
    return RunPlan(
        prompts_per_step=B, samples_per_prompt=G, rows_per_step=N, rows_per_optimizer_step=mini,
        optimizer_steps_per_training_step=module.update_epochs * (N // mini) if N and mini else None,
        micro_batch=micro, training_ranks=ranks, engine_replicas=replicas, total_training_steps=total_steps,
        total_samples=total_steps * N if total_steps is not None and N else None, max_new_tokens=max_new,
        max_generated_tokens_per_step=N * max_new if N and max_new else None,
        notes=tuple(engine.plan_notes()) if engine is not None else ())


def check_plan(B: int | None, G: int, mini_batch_size: int | None, update_epochs: int) -> None:
    """Raise if the rows of a step cannot be split into equal mini-batches."""
    check_int("update_epochs", update_epochs, at_least=1)
    if check_int("mini_batch_size", mini_batch_size, at_least=1, none="the whole step", meaning="rows") is None:
        return
    if not isinstance(B, int):
        return
    N = B * G
    if mini_batch_size > N:
        raise ValueError(
            f"mini_batch_size={mini_batch_size} rows is larger than the batch: {B} prompts x {G} samples = {N} rows "
            f"per step. Set mini_batch_size to a divisor of {N} (e.g. {N} for one optimizer step), or raise the "
            f"loader's batch_size to {prompts_for(mini_batch_size, G, B + 1)} prompts (the fewest whose "
            f"{G} samples each split into mini-batches of {mini_batch_size} rows).")
    if N % mini_batch_size:
        below = max(d for d in range(1, mini_batch_size) if N % d == 0)
        above = next(d for d in range(mini_batch_size + 1, N + 1) if N % d == 0)
        raise ValueError(
            f"mini_batch_size={mini_batch_size} rows does not divide the {N} rows of a step ({B} prompts x {G} "
            f"samples): the last optimizer step would get {N % mini_batch_size} rows. Use mini_batch_size={below} or "
            f"{above} (the nearest divisors of {N}), or set the loader's batch_size to "
            f"{prompts_for(mini_batch_size, G, B + 1)} prompts (the next that splits into mini-batches of "
            f"{mini_batch_size} rows).")


def prompts_for(mini_batch_size: int, G: int, at_least: int) -> int:
    """The fewest prompts, at least ``at_least``, whose ``G`` samples each fill whole mini-batches of
    ``mini_batch_size`` rows: the smallest multiple of ``mini_batch_size / gcd(mini_batch_size, G)``."""
    step = mini_batch_size // math.gcd(mini_batch_size, G)
    return max(-(-at_least // step), 1) * step


def log_plan(plan: RunPlan, loggers: list[Any]) -> None:
    """Log the plan once (rank zero: the controller) and send it to every logger's hyperparameters."""
    log.info("Run plan (a row is one sampled response):\n%s", plan.table())
    for logger in loggers:
        if hasattr(logger, "log_hyperparams"):
            logger.log_hyperparams(plan.as_dict())
