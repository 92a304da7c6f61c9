"""One RL step, top to bottom: reward -> forward passes -> advantage -> policy update -> weight
push, on rows a pipeline generated (:mod:`rltrainer.pipelines`: before the step in sync mode,
during the previous one otherwise). Control flow only; every computation is a module hook, a
Strategy call or an engine call."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.call import call_module
from rltrainer.callbacks.learning_signal import signal_metrics
from rltrainer.data.batch import RolloutBatch
from rltrainer.models.moe import summarize_routing_metrics
from rltrainer.strategies.strategy import combine_metrics, is_extreme

if TYPE_CHECKING:
    from rltrainer.controller.watchdog import Watchdog
    from rltrainer.module import RLModule, StepMetrics
    from rltrainer.rollout.engine import RolloutEngine
    from rltrainer.strategies.strategy import Strategy
    from rltrainer.weights.sync import WeightSync

#: Training steps in a row that skipped every optimizer step before the run stops with an error.
MAX_SKIPPED_STEPS = 3


@dataclass
class FitContext:
    """What the step, the validation loop and a pipeline's run use of a set-up Trainer (it makes
    one per fit): plain objects and values, so that none of them reaches into the Trainer and a
    step runs with fakes and no Trainer at all."""

    module: RLModule
    strategy: Strategy
    engine: RolloutEngine  # the engine the rollout connected
    sync: WeightSync  # the one owner of weight pushes
    watchdog: Watchdog
    seed: int
    step: int  # the trainer's global_step (the policy version the weights have); the loop moves it on
    metrics: StepMetrics  # this step's metrics: what the module logs and the pipeline adds
    #: (name, *args): a lifecycle event, the module's hook, then the callbacks' (default: the module's only)
    call_hooks: Callable[..., None] | None = None
    #: (name, *args): a module hook, its result checked against its contract
    call_module: Callable[..., Any] = field(init=False)
    before_push: Callable[[int], None] = lambda version: None  # a pipeline's run readies its engines for a push

    def __post_init__(self) -> None:
        self.call_module = functools.partial(call_module, self.module)
        self.call_hooks = self.call_hooks or self.call_module


@contextmanager
def timer(metrics: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = time.perf_counter() - start


def training_step(fit: FitContext, batch: RolloutBatch) -> dict[str, float]:
    """Train on ``N`` generated rows (the pipeline made them, see :mod:`rltrainer.pipelines`); return
    the step's metrics (``fit.metrics.current``, what the step logged so far, updated). Ends by
    starting the push of the new weights (version ``step + 1``)."""
    module, strategy, step, metrics = fit.module, fit.strategy, fit.step, fit.metrics.current
    metrics.update(batch.logged)  # what rollout_step logged (in whichever thread ran it), the pipeline's figures
    with timer(metrics, "reward"):
        batch = fit.watchdog.call("reward.reward_step", fit.call_module, "reward_step", batch)  # + scores
    for stage in module.compute_stages():  # old_log_prob, ref, values, ...
        with timer(metrics, stage):
            batch = batch.union(strategy.compute(batch, stage))
    with timer(metrics, "adv"):
        batch = fit.call_module("advantage_step", batch)  # + advantages [N, T]
    module.record_generations(batch, "train")  # sample rows for the loggers, on the steps that log them
    for name, value in signal_metrics(batch).items():  # empty responses, score spread: LearningSignal reads them
        metrics.setdefault(name, value)
    with timer(metrics, "update_actor"):
        metrics.update(update_policy(module, strategy, batch, seed=fit.seed + step))
    with timer(metrics, "update_weights"):
        fit.before_push(step + 1)  # rollouts scheduled with older versions keep them (rltrainer.pipelines)
        metrics.update(fit.sync.push(step + 1))
    metrics.update(staleness_metrics(batch, step))
    return metrics


def staleness_metrics(batch: RolloutBatch, step: int) -> dict[str, float]:
    """How many policy versions behind the trainer the rows were (0 in sync mode)."""
    if "policy_version" not in batch:
        return {}
    lag = (step - batch["policy_version"]).float()  # [N]
    return {"pipeline/staleness_mean": lag.mean().item(), "pipeline/staleness_max": lag.max().item()}


def update_policy(module: RLModule, strategy: Strategy, batch: RolloutBatch, seed: int) -> dict[str, float]:
    """``update_epochs`` passes over the batch in mini-batches of ``mini_batch_size`` rows (shuffled
    with ``seed``), one optimizer step each; metrics are averaged over the optimizer steps
    (``*_max`` / ``*_min``: the extreme over them)."""
    size = module.mini_batch_size or len(batch)
    parts: list[dict[str, float]] = []
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(module.update_epochs):
        order = torch.randperm(len(batch), generator=generator) if epoch > 0 or size < len(batch) else None
        shuffled = batch[order] if order is not None else batch
        for mini_batch in shuffled.split(size):
            mini_batch.global_tokens = max(float(mini_batch["response_mask"].sum()), 1.0)
            mini_batch.global_rows = float(len(mini_batch))
            parts.append(strategy.train_step(mini_batch))
    combined = combine_metrics(parts)
    out = {k: v if is_extreme(k) else v / len(parts) for k, v in combined.items()}
    out["training/optimizer_steps"] = float(len(parts))
    out["training/skipped_optimizer_steps"] = float(sum(not math.isfinite(p.get("actor/grad_norm", 0.0))
                                                        for p in parts))
    return summarize_routing_metrics(out)  # a MoE policy's per-layer, per-expert counts as numbers


def check_skipped_steps(history: list[bool], metrics: dict[str, float], step: int, last: bool) -> None:
    """Raise once ``MAX_SKIPPED_STEPS`` training steps in a row skipped every optimizer step (a
    non-finite gradient norm) or had no row with a finite reward, or the run ends with all its
    steps skipped so. ``history`` holds, per step of this ``fit``, whether it trained nothing;
    this step's entry is appended here."""
    total = metrics.get("training/optimizer_steps", 0.0)
    no_rewards = metrics.get("reward/non_finite_share", 0.0) >= 1.0  # every row left out of the advantages
    history.append(no_rewards or (total > 0 and metrics.get("training/skipped_optimizer_steps", 0.0) == total))
    run = len(history) - next((i + 1 for i in range(len(history) - 1, -1, -1) if not history[i]), 0)
    if run >= MAX_SKIPPED_STEPS or (last and run and run == len(history)):
        raise RuntimeError(f"The last {run} training steps (up to step {step}) trained nothing: "
                           f"{_why_nothing_trained(metrics, no_rewards)}")


def _why_nothing_trained(metrics: dict[str, float], no_rewards: bool) -> str:
    """The cause of a step that trained nothing, named by the metric that shows it and its value."""
    if no_rewards:
        culprits = {k: v for k, v in metrics.items()
                    if k.startswith("reward/") and k.endswith("/non_finite_share") and k != "reward/non_finite_share"
                    and v > 0}
        named = ", ".join(f"{k}={v:g}" for k, v in culprits.items()) or \
            f"reward/non_finite_share={metrics.get('reward/non_finite_share', 0.0):g}"
        return (f"every row's reward was NaN or inf ({named}), so every row was left out of the advantages. "
                "Make the reward function return a finite float for every completion (e.g. 0.0 when it cannot "
                "score one); the warnings above list its non-finite values and rows.")
    norms = {k: v for k, v in metrics.items() if k.endswith("grad_norm") and not math.isfinite(v)}
    named = ", ".join(f"{k}={v}" for k, v in norms.items()) or f"actor/grad_norm={metrics.get('actor/grad_norm')}"
    return (f"every optimizer step was skipped: the gradient norm was not finite ({named}). Check the learning rate "
            "and precision (try '32-true' or 'bf16-mixed' instead of '16-mixed').")


def batch_metrics(batch: RolloutBatch, step_time: float) -> dict[str, float]:
    """Length and throughput metrics with verl's names (``step_time``: wall time since the last
    step). Lengths come from ``attention_mask``, which
    a rollout correction's rejection (applied to ``response_mask``) leaves as generated."""
    T = batch["responses"].shape[1]
    response_lengths = batch["attention_mask"][:, -T:].sum(-1).float()  # [N]
    prompt_lengths = batch["attention_mask"][:, :-T].sum(-1).float()  # [N]
    clipped = [reason == "length" for reason in batch.get("finish_reason", [])]
    total_tokens = float(batch["attention_mask"].sum())
    return {
        "response_length/mean": response_lengths.mean().item(),
        "response_length/max": response_lengths.max().item(),
        "response_length/min": response_lengths.min().item(),
        "response_length/clip_ratio": sum(clipped) / max(len(clipped), 1),
        "prompt_length/mean": prompt_lengths.mean().item(),
        "perf/total_num_tokens": total_tokens,
        "perf/throughput": total_tokens / max(step_time, 1e-9),
    }


def validation_loop(fit: FitContext, dataloader: Any, limit_batches: int | None = None) -> dict[str, float]:
    """Run ``validation_step`` over the loader; average metrics weighted by ``val/rows``."""
    sums: dict[str, float] = {}
    rows = 0.0
    for i, raw in enumerate(dataloader):
        if limit_batches is not None and i >= limit_batches:
            break
        out = fit.watchdog.call("rollout.validation_step", fit.call_module, "validation_step",
                                RolloutBatch.from_loader(raw), fit.engine)  # the engine's calls, watched
        n = out.pop("val/rows", 1.0)
        rows += n
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + v * n
    return {k: v / rows for k, v in sums.items()} if rows else {}
