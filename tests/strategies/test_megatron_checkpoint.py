"""strategy="megatron" checkpoints load on another layout: saved at TP=2, resumed at TP=1 (two
data-parallel ranks, so the distributed optimizer's state is split anew), saved again and resumed
at TP=2, continuing as the uninterrupted TP=2 run does (weights, Adam's moments, the next steps'
loss and gradient norm), within the rounding by which the layouts differ."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rltrainer import GRPO, ModelCheckpoint, Trainer, prompt_dataloader
from rltrainer.callbacks import Callback
from rltrainer.checkpoints import CheckpointError
from rltrainer.models import SafetensorsWeights
from rltrainer.strategies import MegatronStrategy
from rltrainer.testing import length_reward

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (dev extra: pip install -e '.[dev]')")


class Metrics(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def on_step_end(self, trainer, module, metrics):
        self.steps[trainer.global_step] = dict(metrics)


def saved(path):
    """A megatron checkpoint's tensors (``<model>/<kind>/<HF name>``), whole."""
    files = SafetensorsWeights(str(path / "training"))
    return {name: files.read(name) for name in files.names()}


def run(config, tokenizer, prompts, root, tp, max_steps, ckpt=None, devices=2):
    module = GRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8, lr=1e-3,
                  kl_coef=0.05, warmup_steps=2)  # the lr moves at resume
    strategy = MegatronStrategy(devices=devices, tensor_model_parallel_size=tp)
    metrics = Metrics()
    callbacks = [metrics, ModelCheckpoint(dirpath=root, every_n_steps=1, keep=5)]
    with Trainer(strategy=strategy, max_steps=max_steps, logger=False, enable_progress_bar=False, seed=6,
                 default_root_dir=root, callbacks=callbacks) as trainer:
        trainer.fit(module, prompt_dataloader(prompts, batch_size=2), ckpt_path=ckpt)
        return dict(strategy.export_weights()), metrics.steps


def assert_state_close(got, want, what):
    """Weights within 1e-5 (AdamW's steps of lr 1e-3 on layouts that round differently, see
    test_megatron_strategy); moments within 1e-3 of their norm (a near-cancelled gradient element
    differs relatively more)."""
    assert sorted(got) == sorted(want), what
    for name, tensor in want.items():
        if "/weight/" in name:
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=f"{what}: {name}")
        else:
            error = (got[name] - tensor).norm() / tensor.norm().clamp_min(1e-30)
            assert error < 1e-3, f"{what}: {name} differs by {float(error):.2e} of its norm"


@pytest.mark.slow
def test_megatron_checkpoint_reshards_tp2_to_tp1_and_back(bpe_tokenizer, gsm8k_prompts, tmp_path, ray_session):
    from rltrainer.testing import tiny_qwen2_config

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    full, full_metrics = run(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "tp2", tp=2, max_steps=3)
    step1, step2 = saved(tmp_path / "tp2" / "step=1.ckpt"), saved(tmp_path / "tp2" / "step=2.ckpt")
    assert any("/exp_avg_sq/" in n for n in step1) and any("/weight/" in n for n in step1)

    # TP=2 -> TP=1 (DP=2: the optimizer state splits over two data-parallel ranks)
    _, tp1_metrics = run(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "tp1", tp=1, max_steps=2,
                         ckpt=tmp_path / "tp2" / "step=1.ckpt")
    assert list(tp1_metrics) == [2]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"):
        assert tp1_metrics[2][key] == pytest.approx(full_metrics[2][key], rel=1e-4, abs=1e-6), key
    assert_state_close(saved(tmp_path / "tp1" / "step=2.ckpt"), step2, "TP=1 step 2 vs TP=2 step 2")

    # TP=1 -> TP=2
    resumed, back_metrics = run(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "back", tp=2, max_steps=3,
                                ckpt=tmp_path / "tp1" / "step=2.ckpt")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"):
        assert back_metrics[3][key] == pytest.approx(full_metrics[3][key], rel=1e-4, abs=1e-6), key
    for name, tensor in full.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=2e-5, msg=name)

    # another model's checkpoint: the clear error, naming the path and the differing shapes
    other = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=48, num_layers=2)
    with pytest.raises(CheckpointError, match=r"step=2\.ckpt.*does not fit the model: .*model \(48, 48\)"):
        run(other, bpe_tokenizer, gsm8k_prompts, tmp_path / "other", tp=1, max_steps=3,
            ckpt=tmp_path / "tp1" / "step=2.ckpt", devices=1)  # in this process


@pytest.mark.slow
def test_megatron_ranks_checksum_their_files_and_a_corrupt_one_is_named(bpe_tokenizer, gsm8k_prompts, tmp_path,
                                                                       ray_session):
    """checksums.json lists every file both TP ranks wrote (each hashed by its rank); random bytes in
    one raise a CheckpointError naming it before any tensor is read."""
    from rltrainer.testing import scribble, tiny_qwen2_config

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    run(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "tp2", tp=2, max_steps=1)
    checkpoint = tmp_path / "tp2" / "step=1.ckpt"
    files = json.loads((checkpoint / "checksums.json").read_text())["files"]
    written = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    assert sorted(files) == [n for n in written if n != "checksums.json"]
    assert "training/state.pt" in files and any(n.startswith("training/rank=1-") for n in files)
    part = next(n for n in sorted(files) if n.startswith("training/rank=1-"))
    scribble(checkpoint / part)
    with pytest.raises(CheckpointError, match=rf"{checkpoint}/{part} is corrupted: its sha256 is [0-9a-f]{{64}}"):
        run(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "other", tp=1, max_steps=2, ckpt=checkpoint,
            devices=1)


class GroupStepAdam(torch.optim.AdamW):
    """AdamW that counts its steps per param group (``group["step"]``, an int), as Transformer
    Engine's and apex's FusedAdam do (what megatron-core steps with whenever either imports); its
    per-parameter state is ``exp_avg`` and ``exp_avg_sq`` only, and its ``state_dict`` refuses
    another, as Transformer Engine's does (``get_unscaled_state``: ``name_to_dtype_map[name]``).
    A subclass of AdamW for megatron's distributed optimizer, which asserts one."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True):
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            correction1, correction2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                grad = p.grad if self.adam_w_mode else p.grad + group["weight_decay"] * p
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / correction1)

    def state_dict(self):
        for state in self.state.values():
            for name in state:
                {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}[name]  # KeyError, as Transformer Engine's
        return super().state_dict()


def run_in_process(config, tokenizer, prompts, root, max_steps, ckpt=None, **strategy):
    """One megatron rank in this process; its exported weights, the trainer and its torch optimizers."""
    module = GRPO(config, tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8, lr=1e-2,
                  kl_coef=0.05)
    callbacks = [ModelCheckpoint(dirpath=root, every_n_steps=1, keep=5)]
    with Trainer(strategy=MegatronStrategy(devices=1, **strategy), max_steps=max_steps, logger=False,
                 enable_progress_bar=False, seed=6, default_root_dir=root, callbacks=callbacks) as trainer:
        trainer.fit(module, prompt_dataloader(prompts, batch_size=2), ckpt_path=ckpt)
        chained = trainer.strategy.group.worker._optimizer.megatron.chained_optimizers
        return dict(trainer.strategy.export_weights()), [opt.optimizer for opt in chained]


def test_megatron_checkpoint_saves_and_resumes_where_the_default_group_refuses_cpu_tensors(
        bpe_tokenizer, gsm8k_prompts, tmp_path):
    """On a GPU the default group is NCCL, which refuses CPU tensors ("No backend type associated
    with device type cpu"); the checkpoint's step count and param groups are host data and go over
    a gloo group (rltrainer.process_groups.host_group). nccl_rule() imitates NCCL's rule here."""
    from rltrainer.testing import tiny_qwen2_config
    from rltrainer.testing.nccl_rule import nccl_rule

    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    with nccl_rule():
        run_in_process(config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=1)
        run_in_process(config, bpe_tokenizer, gsm8k_prompts, tmp_path, max_steps=2, ckpt=tmp_path / "step=1.ckpt")
    assert (tmp_path / "step=2.ckpt" / "training" / "state.pt").is_file()


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed-optimizer", "replicated-optimizer"])
def test_megatron_resume_continues_adam_steps_counted_per_param_group(distributed, bpe_tokenizer, gsm8k_prompts,
                                                                     tmp_path, monkeypatch):
    """With Transformer Engine or apex installed, megatron-core's Adam is their FusedAdam, which
    counts steps in its param groups: a resumed run keeps that count (Adam's bias correction goes
    on from it), so it equals the uninterrupted run."""
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    from rltrainer.testing import tiny_qwen2_config

    monkeypatch.setattr(megatron_optimizer, "Adam", GroupStepAdam)  # as when TE or apex imports
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=32, num_layers=2)
    options = {"use_distributed_optimizer": distributed}
    full, full_optimizers = run_in_process(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "full", 3, **options)
    assert [type(o) for o in full_optimizers] == [GroupStepAdam]
    assert {g["step"] for g in full_optimizers[0].param_groups} == {3}
    run_in_process(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "first", 2, **options)
    resumed, optimizers = run_in_process(config, bpe_tokenizer, gsm8k_prompts, tmp_path / "resumed", 3,
                                         ckpt=tmp_path / "first" / "step=2.ckpt", **options)
    for name, tensor in full.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert {g["step"] for g in optimizers[0].param_groups} == {3}
    optimizers[0].state_dict()  # no per-parameter "step", which Transformer Engine's state_dict refuses
