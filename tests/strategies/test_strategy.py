"""What every Strategy does alike around the optimizer step (rltrainer.strategies.strategy): the
module's ``on_before_optimizer_step`` and ``gradient_clip_norm`` hooks run on the ranks before the
step and decide it, and ``load_checkpoint(..., optimizer=False)`` loads the models with a fresh
optimizer. One rank in this process per strategy (``fsdp2`` and ``megatron`` run their rank code,
``TrainingWorker``, in-process at ``devices=1``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rltrainer import GRPO
from rltrainer.data.batch import RolloutBatch
from rltrainer.strategies import FSDP2Strategy, MegatronStrategy, SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")


class StepHooksGRPO(GRPO):
    """GRPO stepped by plain SGD at lr 1e-3, whose hooks set the step's lr to 0.5 and its clip to
    1e-3: then the weights move by exactly ``0.5 * 1e-3`` in norm (SGD's step is ``-lr * g`` and
    the clipped ``g`` has norm 1e-3), and by something else if either hook is not taken."""

    hook_lr, clip_to = 0.5, 1e-3

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=1e-3)

    def on_before_optimizer_step(self, optimizer):
        for group in optimizer.param_groups:
            group["lr"] = self.hook_lr

    def gradient_clip_norm(self, gradient_clip_val):
        assert gradient_clip_val is None  # the strategy's own setting is the default answer
        return self.clip_to


STEP_HOOK_STRATEGIES = {
    "single": lambda: SingleDeviceStrategy(device="cpu", gradient_clip_val=None),
    "fsdp2": lambda: FSDP2Strategy(devices=1, gradient_clip_val=None),
    "megatron": lambda: MegatronStrategy(devices=1, gradient_clip_val=None, use_distributed_optimizer=False),  # SGD
}


def strategies(names):
    return [pytest.param(n, marks=needs_megatron) if n.startswith("megatron") else n for n in names]


def module(config, tokenizer, cls=GRPO, **kwargs):
    return cls(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=6, lr=1e-3, **kwargs)


def batch_for(config, tokenizer, prompts):
    """One step's batch, rolled out by a ``single`` strategy (the same rows for every strategy)."""
    single = SingleDeviceStrategy(device="cpu")
    single.setup(module(config, tokenizer), seed=3)
    torch.manual_seed(0)
    return prepared_batch(single.module, single, RolloutBatch.from_rows([prompts[i] for i in range(2)]))


@pytest.mark.parametrize("name", strategies(STEP_HOOK_STRATEGIES))
def test_the_optimizer_step_hooks_set_the_lr_and_clip_on_every_strategy(name, tiny_config, bpe_tokenizer,
                                                                        gsm8k_prompts):
    batch = batch_for(tiny_config, bpe_tokenizer, gsm8k_prompts)
    strategy = STEP_HOOK_STRATEGIES[name]()
    try:
        strategy.setup(module(tiny_config, bpe_tokenizer, cls=StepHooksGRPO), seed=3)
        before = {n: t.clone() for n, t in strategy.export_weights()}
        metrics = strategy.train_step(batch)
        moved = torch.linalg.vector_norm(torch.stack([(t - before[n]).norm() for n, t in strategy.export_weights()]))
        assert metrics["actor/grad_norm"] > 10 * StepHooksGRPO.clip_to  # the clip binds
        assert metrics["actor/lr"] == StepHooksGRPO.hook_lr
        assert float(moved) == pytest.approx(StepHooksGRPO.hook_lr * StepHooksGRPO.clip_to, rel=1e-3)
    finally:
        strategy.teardown()


LOAD_STRATEGIES = {
    "single": lambda: SingleDeviceStrategy(device="cpu"),
    "fsdp2": lambda: FSDP2Strategy(devices=1),
    "megatron": lambda: MegatronStrategy(devices=1),
    "megatron-bf16": lambda: MegatronStrategy(devices=1, precision="bf16-true"),
    "megatron-bf16-replicated": lambda: MegatronStrategy(devices=1, precision="bf16-true",
                                                         use_distributed_optimizer=False),
}


def rank_optimizers(strategy):
    """The torch optimizers the rank steps (megatron: megatron-core's inner ones) and its schedulers."""
    owner = strategy if isinstance(strategy, SingleDeviceStrategy) else strategy.group.worker
    if isinstance(strategy, MegatronStrategy):
        return owner._optimizer.inner_optimizers(), owner.schedulers
    return owner.optimizers, owner.schedulers


def step_count(optimizers) -> float:
    steps = [float(s["step"]) for opt in optimizers for s in opt.state.values() if "step" in s]
    return max(steps, default=0.0)


@pytest.mark.parametrize("name", strategies(LOAD_STRATEGIES))
def test_load_checkpoint_without_the_optimizer_loads_the_models_and_a_fresh_optimizer(name, tiny_config,
                                                                                      bpe_tokenizer, gsm8k_prompts,
                                                                                      tmp_path):
    """Step, save, step, load without the optimizer: the saved weights, an optimizer without state
    (no moments, step count 0; megatron's bf16 main parameters equal to the loaded weights) and the
    LR scheduler as saved; the next step counts 1. Loading with it (the default) restores the count."""
    batch = batch_for(tiny_config, bpe_tokenizer, gsm8k_prompts)
    strategy = LOAD_STRATEGIES[name]()
    try:
        strategy.setup(module(tiny_config, bpe_tokenizer, warmup_steps=3), seed=3)
        strategy.train_step(batch)
        (tmp_path / "one").mkdir()
        state = strategy.save_checkpoint(tmp_path / "one")
        strategy.wait_checkpoint()
        saved = {n: t.clone() for n, t in strategy.export_weights()}
        strategy.train_step(batch)
        optimizers, schedulers = rank_optimizers(strategy)
        assert step_count(optimizers) == 2 and schedulers[0].last_epoch == 2

        strategy.load_checkpoint(tmp_path / "one", state, optimizer=False)
        for n, t in strategy.export_weights():
            assert torch.equal(t, saved[n]), n
        optimizers, schedulers = rank_optimizers(strategy)
        assert all(not opt.state for opt in optimizers) and schedulers[0].last_epoch == 1
        assert all("step" not in g for opt in optimizers for g in opt.param_groups)
        if isinstance(strategy, MegatronStrategy):
            worker = strategy.group.worker
            params = {id(p): p for m in worker.module.trainable_models().values() for p in m.parameters()}
            for key, (_, main, rows) in worker._optimizer.state_slots().items():
                model = params[key].detach().float().reshape(-1)
                assert torch.equal(main.detach().reshape(-1), model if rows is None else model[rows])
        strategy.train_step(batch)
        assert step_count(rank_optimizers(strategy)[0]) == 1

        strategy.load_checkpoint(tmp_path / "one", state)
        assert step_count(rank_optimizers(strategy)[0]) == 1 and rank_optimizers(strategy)[1][0].last_epoch == 1
    finally:
        strategy.teardown()
