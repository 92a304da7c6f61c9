"""Settings where a Lightning or TRL user looks for them: micro-batching and clipping as Trainer
arguments, exported engine classes, LR schedules by transformers' names."""

from __future__ import annotations

import math

import pytest
import torch

from rltrainer import (GRPO, FSDP2Strategy, Logger, SGLangEngine, SingleDeviceStrategy, Trainer, VLLMEngine,
                       prompt_dataloader)
from rltrainer.schedulers import build_lr_scheduler, estimate_optimizer_steps


def length_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def make_module(config, tokenizer, **kwargs):
    defaults = dict(reward_funcs=length_reward, num_generations=2, max_new_tokens=6, lr=1e-3)
    return GRPO(config, tokenizer, **{**defaults, **kwargs})


# -- item 3: micro-batches, token budget, clipping ------------------------------------------------------
@pytest.mark.parametrize("name", ["single", "fsdp2", "fsdp2_offload"])
def test_micro_batching_and_clipping_by_name(name):
    from rltrainer.strategies.strategy import build_strategy

    s = build_strategy(name, micro_batch_size=3, max_tokens_per_micro_batch=256, gradient_clip_val=0.5)
    assert (s.micro_batch_size, s.max_tokens_per_micro_batch, s.gradient_clip_val) == (3, 256, 0.5)
    s = Trainer(strategy=name, gradient_clip_val=0.5, logger=False, enable_progress_bar=False).strategy
    assert s.gradient_clip_val == 0.5
    if isinstance(s, FSDP2Strategy):
        assert s.options["gradient_clip_val"] == 0.5  # what the ranks read
    untouched = Trainer(strategy=name, logger=False, enable_progress_bar=False).strategy
    assert (untouched.micro_batch_size, untouched.max_tokens_per_micro_batch, untouched.gradient_clip_val) == (8, None, 1.0)
    assert Trainer(strategy=name, gradient_clip_val=None, logger=False).strategy.gradient_clip_val is None


def test_strategy_instance_keeps_its_own_settings_and_conflicts_raise():
    strategy = SingleDeviceStrategy(micro_batch_size=2, gradient_clip_val=None)
    assert Trainer(strategy=strategy, logger=False).strategy is strategy  # Trainer defaults: the instance's
    assert Trainer(strategy=strategy, gradient_clip_val=None, logger=False).strategy is strategy  # agrees
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=0.5\) conflicts.*gradient_clip_val=None"):
        Trainer(strategy=strategy, gradient_clip_val=0.5)
    with pytest.raises(ValueError, match=r"Trainer\(precision='bf16-mixed'\) conflicts"):
        Trainer(strategy=strategy, precision="bf16-mixed")


@pytest.mark.parametrize("kwargs, match", [
    ({"micro_batch_size": 0}, r"micro_batch_size must be an int >= 1.*got 0"),
    ({"max_tokens_per_micro_batch": -5}, r"max_tokens_per_micro_batch must be an int >= 1.*got -5"),
    ({"gradient_clip_val": 0.0}, r"gradient_clip_val must be a number > 0.*or None \(no clipping\), got 0.0"),
])
def test_bad_micro_batch_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        (Trainer if "gradient_clip_val" in kwargs else FSDP2Strategy)(**kwargs)


def test_micro_batch_size_from_the_trainer_reaches_the_hooks(tiny_config, bpe_tokenizer, gsm8k_prompts):
    sizes: list[int] = []

    class Counting(GRPO):
        def policy_step(self, micro_batch):
            sizes.append(len(micro_batch))
            return super().policy_step(micro_batch)

    module = Counting(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=4)
    trainer = Trainer(strategy=SingleDeviceStrategy(micro_batch_size=3), max_steps=1, logger=False,
                      enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4))
    assert sizes == [3, 3, 2]  # 8 rows in micro-batches of 3


def test_engine_classes_are_exported_with_their_memory_and_length_settings():
    vllm = VLLMEngine(gpu_memory_utilization=0.7, max_model_len=4096)
    assert (vllm.gpu_memory_utilization, vllm.max_model_len) == (0.7, 4096)
    sglang = SGLangEngine(mem_fraction_static=0.6, context_length=4096)
    assert sglang.mem_fraction_static == 0.6 and sglang.engine_kwargs["context_length"] == 4096
    with pytest.raises(ValueError, match="context_length=2048 and engine_kwargs"):
        SGLangEngine(context_length=2048, engine_kwargs={"context_length": 4096})
    assert Trainer(rollout=vllm, logger=False).engine is vllm  # no GPU needed until setup


# -- item 4: LR schedules ---------------------------------------------------------------------------------
def reference_lrs(name, warmup, total, steps, lr=1.0):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decaying_schedules_follow_transformers(name):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, name, warmup_steps=2, total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx(reference_lrs(name, 2, 10, 10))
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1.0) and lrs[-1] < lrs[5] < lrs[2]
    if name == "cosine":
        assert lrs[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))


def test_constant_schedule_and_bad_schedules(tiny_config, bpe_tokenizer):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert build_lr_scheduler(opt, "constant", 0, None).get_last_lr() == [1.0]  # no horizon needed
    with pytest.raises(ValueError, match=r"lr_scheduler_type='cosine' decays over the run.*max_steps"):
        build_lr_scheduler(opt, "cosine", 0, None)
    with pytest.raises(ValueError, match=r"Unknown lr_scheduler_type 'cosin'.*'cosine'"):
        GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, lr_scheduler_type="cosin")
    with pytest.raises(ValueError, match=r"'reduce_lr_on_plateau' is not supported"):
        GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, lr_scheduler_type="reduce_lr_on_plateau")


def test_optimizer_step_estimate():
    class M:
        sampling = type("S", (), {"n": 4})()
        update_epochs, mini_batch_size = 2, 6
    assert estimate_optimizer_steps(10, M(), 3) == 10 * 2 * 2  # 12 rows in mini-batches of 6, twice
    assert estimate_optimizer_steps(None, M(), 3) is None


def test_cosine_schedule_over_a_fit(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = make_module(tiny_config, bpe_tokenizer, lr_scheduler_type="cosine", warmup_steps=1, mini_batch_size=4)
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False)
    lrs: list[float] = []
    original = trainer.strategy.train_step
    trainer.strategy.train_step = lambda mb: (out := original(mb), lrs.append(out["actor/lr"]))[0]
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=4))
    assert module.estimated_optimizer_steps == 4  # 2 steps x (8 rows / mini-batches of 4)
    assert lrs == pytest.approx(reference_lrs("cosine", 1, 4, 4, lr=1e-3))


# -- item 6: logger identity and hyperparameters ----------------------------------------------------------
def test_wandb_gets_project_name_and_a_run_id_that_a_restart_reuses(tmp_path):
    from rltrainer.loggers import WANDB_ID_FILE, logger_kwargs

    first = logger_kwargs("wandb", tmp_path, "gsm8k-grpo", "qwen-0.5b", None)
    assert first["project"] == "gsm8k-grpo" and first["name"] == "qwen-0.5b" and first["resume"] == "allow"
    assert first["save_dir"] == str(tmp_path) and (tmp_path / WANDB_ID_FILE).read_text() == first["id"]
    assert logger_kwargs("wandb", tmp_path, "gsm8k-grpo", "qwen-0.5b", None)["id"] == first["id"]  # the restart
    assert logger_kwargs("wandb", tmp_path / "other", None, None, "abc123")["id"] == "abc123"
    assert logger_kwargs("csv", tmp_path, None, None, None) == {"save_dir": str(tmp_path), "name": "lightning_logs",
                                                              "version": None}
    assert logger_kwargs("tensorboard", tmp_path, "p", "r", None) == {"save_dir": str(tmp_path), "name": "p", "version": "r"}


def test_trainer_builds_wandb_with_its_identity(tmp_path, monkeypatch):
    import types

    built = {}

    class FakeWandbLogger:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def log_metrics(self, metrics, step):
            pass

    fake = types.ModuleType("fake_loggers")
    fake.WandbLogger = FakeWandbLogger
    monkeypatch.setitem(__import__("sys").modules, "fake_loggers", fake)
    monkeypatch.setitem(__import__("rltrainer.loggers").loggers.LOGGER_NAMES, "wandb", ("fake_loggers", "WandbLogger"))
    Trainer(logger=Logger("wandb", project="p", run_name="r"), default_root_dir=tmp_path, enable_progress_bar=False)
    assert built["project"] == "p" and built["name"] == "r" and built["resume"] == "allow" and built["id"]


def test_every_logger_gets_the_hyperparameters(tiny_config, bpe_tokenizer, gsm8k_prompts):
    class Recording:
        def __init__(self):
            self.params = None

        def log_hyperparams(self, params):
            self.params = params

        def log_metrics(self, metrics, step):
            pass

        def save(self):
            pass

    a, b = Recording(), Recording()
    module = make_module(tiny_config, bpe_tokenizer, lr_scheduler_type="linear", clip_ratio_high=0.28)
    Trainer(strategy=SingleDeviceStrategy(micro_batch_size=4), max_steps=1, logger=[a, b],
            enable_progress_bar=False).fit(
        module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert a.params == b.params
    p = a.params
    assert p["module/lr"] == 1e-3 and p["module/lr_scheduler_type"] == "linear"
    assert p["module/policy_loss_kwargs/clip_ratio_high"] == 0.28 and p["module/sampling/n"] == 2
    assert p["trainer/max_steps"] == 1 and p["strategy/micro_batch_size"] == 4 and p["module/estimated_optimizer_steps"] == 1
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in p.values())
