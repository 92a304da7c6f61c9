"""Every call the primitives make into rltrainer's Strategy, weight sync and rollout engine, in one
place: when those interfaces move (the sync owner's verbs, engine placement), this module changes
and the clients do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rltrainer.data.batch import RolloutBatch
from rltrainer.rollout.engine import Generation, RolloutEngine, SamplingParams
from rltrainer.rollout.rollout import Rollout, resolve_rollout
from rltrainer.strategies.strategy import Strategy, build_strategy
from rltrainer.weights.sync import WeightSync


def make_strategy(strategy: str | Strategy, **kwargs: Any) -> Strategy:
    """A registered strategy name (``"single"``...) built with ``kwargs``, or the instance (then no ``kwargs``)."""
    if isinstance(strategy, Strategy) and kwargs:
        raise ValueError(f"Strategy settings {sorted(kwargs)} go to a strategy built by name; the instance "
                         f"{type(strategy).__name__} has its own: set them on it")
    return build_strategy(strategy, **kwargs)


def setup(strategy: Strategy, module: Any, seed: int) -> None:
    if module.lora is not None and not getattr(strategy, "trains_lora", True):
        raise ValueError(f"The {type(strategy).__name__} trains every parameter, not LoRA adapters: a TrainingClient "
                         f"with rank= or lora= runs on strategy='single' or 'fsdp2'; on this strategy pass neither "
                         "(full-parameter training)")
    strategy.setup(module, seed)


def teardown(strategy: Strategy) -> None:
    strategy.teardown()


def teardown_engine(rollout: Rollout, sync: WeightSync) -> None:
    """Release what :func:`connect` set up, as ``Trainer.teardown`` does: the push in flight ends,
    then the engine, then the rollout's replica processes and its end of their transport."""
    sync.close()
    try:
        sync.engine.teardown()
    finally:
        rollout.close()


def compute(strategy: Strategy, batch: RolloutBatch, stage: str) -> RolloutBatch:
    """``module.compute_step`` over ``batch`` under no_grad, wherever the strategy's ranks are."""
    return strategy.compute(batch, stage)


def train_step(strategy: Strategy, batch: RolloutBatch, adam: Any) -> dict[str, Any]:
    """One optimizer step over ``batch`` (gradients of every row summed, clipped to
    ``adam.grad_clip_norm`` unless 0) with AdamW set to ``adam``'s hyperparameters: they travel in
    ``batch.meta`` to every rank, where the module's ``on_before_optimizer_step`` and
    ``gradient_clip_norm`` hooks set them (:class:`~rltrainer.own_loop.module.PrimitivesModule`)."""
    batch.meta["adam"] = {"lr": adam.learning_rate, "betas": (adam.beta1, adam.beta2), "eps": adam.eps,
                          "weight_decay": adam.weight_decay}
    batch.meta["grad_clip_norm"] = adam.grad_clip_norm
    return strategy.train_step(batch)


def save_state(strategy: Strategy, directory: Path) -> dict[str, Any]:
    """Models, optimizers and schedulers into ``directory`` (new); the small state to keep."""
    directory.mkdir(parents=True)
    state = strategy.save_checkpoint(directory)
    strategy.wait_checkpoint()
    return state


def load_state(strategy: Strategy, directory: Path, state: dict[str, Any], optimizer: bool) -> None:
    """The inverse of :func:`save_state`; without ``optimizer`` the optimizer starts afresh (no
    moments, step 0) on the loaded weights."""
    strategy.load_checkpoint(directory, state, optimizer=optimizer)


def connect(strategy: Strategy, rollout: str | RolloutEngine | Rollout, tokenizer: Any) -> tuple[Rollout, WeightSync]:
    """Place ``rollout`` (a :class:`~rltrainer.rollout.rollout.Rollout`, or an engine or its name:
    that engine with the Rollout's defaults) beside ``strategy``; returns the Rollout and the owner
    of its weight sync (both for :func:`teardown_engine`)."""
    placed = resolve_rollout(rollout)
    return placed, placed.connect(strategy, tokenizer, mode="wait")


def push(sync: WeightSync, version: int) -> dict[str, float]:
    """Push the strategy's current weights into the connected engine as ``version`` and wait."""
    return sync.push(version, mode="wait")


def generate(sync: Any, prompts: list[list[int]], sampling: SamplingParams) -> Generation:
    return sync.engine.generate(prompts, sampling)


def prompt_logprobs(sync: WeightSync, tokens: list[int]) -> list[float | None]:
    """The engine's log-prob of each token given the ones before it (``None`` for the first), from
    the weights it holds (:meth:`~rltrainer.rollout.engine.RolloutEngine.prompt_log_probs`)."""
    return sync.engine.prompt_log_probs(tokens)


def engine_version(sync: WeightSync, trained: int) -> int:
    """The policy version the engine's weights are: the last push's; for an engine bound to the
    policy's own parameters (``HFEngine(share_weights=True)`` beside an in-process strategy), the
    version the strategy holds now (``trained``): an optimizer step changes them without a push."""
    return trained if getattr(sync.engine, "_bound", None) else sync.version
