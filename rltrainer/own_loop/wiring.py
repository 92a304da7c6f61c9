"""Every call the primitives make into rltrainer's Strategy, weight sync and rollout engine, in one
place: when those interfaces move (the sync owner's verbs, engine placement), this module changes
and the clients do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.rollout.engine import Generation, RolloutEngine, SamplingParams
from rltrainer.rollout.rollout import Rollout, resolve_rollout
from rltrainer.strategies import MegatronStrategy
from rltrainer.strategies.strategy import Strategy, build_strategy
from rltrainer.weights.sync import WeightSync


def make_strategy(strategy: str | Strategy, **kwargs: Any) -> Strategy:
    """A registered strategy name (``"single"``...) built with ``kwargs``, or the instance (then no ``kwargs``)."""
    if isinstance(strategy, Strategy) and kwargs:
        raise ValueError(f"Strategy settings {sorted(kwargs)} go to a strategy built by name; the instance "
                         f"{type(strategy).__name__} has its own: set them on it")
    built = build_strategy(strategy, **kwargs)
    if isinstance(built, MegatronStrategy):  # it turns the module's optimizer into megatron-core's own
        raise NotImplementedError("The primitives set each optim_step's AdamParams on the module's torch optimizer, "
                                  "which the megatron strategy replaces by megatron-core's: use 'single' or 'fsdp2'")
    return built


def setup(strategy: Strategy, module: Any, seed: int) -> None:
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
    ``adam.grad_clip_norm`` unless 0) with AdamW set to ``adam``'s hyperparameters (by the module,
    on each rank: ``meta["adam"]``)."""
    batch.meta["adam"] = {"lr": adam.learning_rate, "betas": (adam.beta1, adam.beta2), "eps": adam.eps,
                          "weight_decay": adam.weight_decay}
    clip = adam.grad_clip_norm or None
    if hasattr(strategy, "optimizers"):  # in this process: the clip is read at each step
        strategy.gradient_clip_val = clip
    elif clip != strategy.gradient_clip_val:
        raise ValueError(f"AdamParams(grad_clip_norm={adam.grad_clip_norm}) differs from the "
                         f"{type(strategy).__name__}'s gradient_clip_val={strategy.gradient_clip_val}, which its ranks "
                         "took at setup: build the strategy with gradient_clip_val equal to it (None for 0)")
    return strategy.train_step(batch)


def _local_optimizers(strategy: Strategy) -> list[torch.optim.Optimizer]:
    if not hasattr(strategy, "optimizers"):  # the optimizers live in worker processes
        raise NotImplementedError(f"{type(strategy).__name__}: loading weights without the optimizer state clears "
                                  "the optimizers in this process, so only the 'single' strategy does it yet; "
                                  "load_state_with_optimizer runs on every strategy")
    return strategy.optimizers


def save_state(strategy: Strategy, directory: Path) -> dict[str, Any]:
    """Models, optimizers and schedulers into ``directory`` (new); the small state to keep."""
    directory.mkdir(parents=True)
    state = strategy.save_checkpoint(directory)
    strategy.wait_checkpoint()
    return state


def load_state(strategy: Strategy, directory: Path, state: dict[str, Any], optimizer: bool) -> None:
    """The inverse of :func:`save_state`; without ``optimizer`` the optimizer starts afresh (no
    moments, step 0) on the loaded weights."""
    strategy.load_checkpoint(directory, state)
    if not optimizer:
        for opt in _local_optimizers(strategy):
            opt.state.clear()


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
