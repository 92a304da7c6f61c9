"""Every numeric setting of every class a user builds is checked where it is written
(:mod:`rltrainer.values`): a float for an int (``max_new_tokens=2.5``, even ``2.0``), a bool, a string
or NaN is refused by the constructor, naming the setting, instead of failing later inside torch.

The table below lists them by class; :func:`test_the_table_lists_every_numeric_setting` reads the
constructors' signatures, so a numeric setting added later without a check fails here."""

from __future__ import annotations

import inspect
import math
import typing
from types import SimpleNamespace

import numpy as np
import pytest

from rltrainer import (DAPO, GRPO, PPO, AsyncPipeline, HFEngine, LearningSignal, LogGenerations, ModelCheckpoint,
                       PolicyGradient, RewardModel, SamplingParams, SGLangEngine, SingleDeviceStrategy, Teacher, Trainer,
                       VLLMEngine)
from rltrainer.algorithms.parts import Critic, CriticAdvantage, KLPenalty, PolicyLoss, RewardModelScores, Routing
from rltrainer.data import PromptDataModule, prompt_dataloader
from rltrainer.envs import Environment, MultiTurn, StepResult
from rltrainer.modules.settings import Optimizer, Rewards
from rltrainer.rewards import RewardManager
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies.dispatch import WorkerGroupStrategy
from rltrainer.strategies.fsdp2 import FSDP2Strategy
from rltrainer.strategies.megatron.strategy import MegatronStrategy
from rltrainer.strategies.strategy import Strategy
from rltrainer.toy import ProblemsData
from rltrainer.values import SettingError, check_float, check_int
from rltrainer.weights.delta import DeltaSync

TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)  # all a module's constructor reads of it


def reward(completions, **kwargs):
    return [0.0] * len(completions)


class Quiet(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "hi"}]

    def step(self, text):
        return StepResult("ok", reward=0.0, done=True)


QUIET = {"logger": False, "enable_progress_bar": False}
#: class -> (how to build it with one setting, its int settings, its float settings)
BUILDERS: dict[type, tuple[typing.Callable[..., object], tuple[str, ...], tuple[str, ...]]] = {
    Trainer: (lambda **kw: Trainer(**QUIET, **kw),
              ("devices", "num_nodes", "max_steps", "max_epochs", "val_check_interval", "limit_val_batches",
               "log_every_n_steps", "seed", "fast_dev_run"), ("log_flush_s", "gradient_clip_val", "stage_timeout_s")),
    PolicyGradient: (lambda **kw: GRPO("config", TOKENIZER, reward, **kw),
           ("num_generations", "max_new_tokens", "top_k", "update_epochs", "mini_batch_size", "model_seed",
            "warmup_steps", "reward_num_workers"),
           ("temperature", "top_p", "lr", "weight_decay", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
            "kl_coef", "entropy_coef", "router_aux_loss_coef", "reward_timeout")),
    PPO: (lambda **kw: PPO("config", TOKENIZER, reward, **kw), (),
          ("critic_lr", "vf_coef", "cliprange_value", "gamma", "lam", "kl_in_reward_coef")),
    DAPO: (lambda **kw: DAPO("config", TOKENIZER, reward, **kw), ("max_gen_rounds", "overlong_buffer_len"),
           ("overlong_penalty_factor",)),
    Teacher: (lambda **kw: Teacher("config", **kw), ("seed",), ("coef",)),
    RewardModel: (lambda **kw: RewardModel("config", **kw), ("seed",), ()),
    RewardModelScores: (lambda **kw: RewardModelScores(RewardModel("config"), **kw), (), ("weight",)),
    SamplingParams: (SamplingParams, ("n", "max_new_tokens", "top_k", "seed"), ("temperature", "top_p")),
    HFEngine: (HFEngine, ("max_batch_size",), ()),
    VLLMEngine: (VLLMEngine, ("tensor_parallel_size", "max_model_len", "max_lora_rank", "kv_cache_memory_bytes"),
                 ("gpu_memory_utilization",)),
    SGLangEngine: (SGLangEngine, ("tp_size", "bucket_bytes", "max_lora_rank", "context_length"),
                   ("mem_fraction_static",)),
    Strategy: (SingleDeviceStrategy, ("micro_batch_size", "max_tokens_per_micro_batch"), ("gradient_clip_val",)),
    WorkerGroupStrategy: (FSDP2Strategy, ("devices", "num_nodes", "threads_per_worker"),
                          ("cpus_per_worker", "gpus_per_worker")),
    Rollout: (Rollout, ("replicas", "bucket_bytes"), ("sync_timeout_s",)),
    MegatronStrategy: (MegatronStrategy, ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                          "expert_model_parallel_size", "ddp_bucket_size"), ()),
    DeltaSync: (DeltaSync, ("checksum_every",), ("max_share",)),
    LearningSignal: (LearningSignal, ("patience",), ()),
    LogGenerations: (LogGenerations, ("every_n_steps", "rows"), ()),
    ModelCheckpoint: (ModelCheckpoint, ("every_n_steps", "keep", "save_top_k"), ()),
    ProblemsData: (lambda **kw: ProblemsData(lambda rng: rng.randrange(10**6), lambda p: (str(p), str(p)), **kw),
                   ("num_train", "num_val", "seed", "batch_size", "val_batch_size"), ()),
    PromptDataModule: (lambda **kw: PromptDataModule("train.jsonl", **kw),
                       ("batch_size", "val_batch_size", "max_prompt_length", "limit_train_rows", "limit_val_rows",
                        "seed"), ()),
    AsyncPipeline: (AsyncPipeline, ("max_staleness",), ()),
    MultiTurn: (lambda **kw: MultiTurn(Quiet, **kw), ("max_turns", "max_episode_tokens", "max_workers"),
                ("batch_wait_s", "env_timeout_s")),
    RewardManager: (lambda **kw: RewardManager([reward], **kw), ("num_workers", "max_concurrency"), ("timeout",)),
    Optimizer: (Optimizer, ("warmup_steps",), ("lr", "weight_decay")),
    Rewards: (Rewards, ("reward_num_workers",), ("reward_timeout",)),
    PolicyLoss: (PolicyLoss, (), ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coef")),
    KLPenalty: (KLPenalty, (), ("kl_coef",)),
    Critic: (Critic, (), ("critic_lr", "vf_coef", "cliprange_value")),
    CriticAdvantage: (CriticAdvantage, (), ("gamma", "lam", "kl_in_reward_coef")),
    Routing: (Routing, (), ("router_aux_loss_coef",)),
}
#: Numeric settings checked elsewhere (not by this table's rules): none today.
ELSEWHERE: set[tuple[str, str]] = set()

CASES = [(cls, name, kind) for cls, (_, ints, floats) in BUILDERS.items()
         for kind, names in (("int", ints), ("float", floats)) for name in names]
BAD = {"int": [2.5, 2.0, True, "3", math.nan], "float": [True, "0.5", math.nan, None]}


@pytest.mark.parametrize("cls, name, kind", CASES, ids=[f"{c.__name__}.{n}" for c, n, _ in CASES])
def test_a_bad_number_is_refused_by_the_constructor_naming_the_setting(cls, name, kind):
    build = BUILDERS[cls][0]
    bad = [v for v in BAD[kind] if not (v is None and _takes_none(cls, name))]
    if name == "fast_dev_run":  # a bool is its own spelling (True: one step)
        bad.remove(True)
    for value in bad:
        with pytest.raises(SettingError, match=rf"{name}(\[.*\])? must be (an int|a number)") as info:
            build(**{name: {"reward": value} if name == "stage_timeout_s" else value})
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
        assert repr(value) in str(info.value) or "nan" in str(info.value)


def _takes_none(cls: type, name: str) -> bool:
    parameter = _numeric_parameters(cls).get(name)
    return parameter is not None and "None" in str(parameter)


def _numeric_parameters(cls: type) -> dict[str, str]:
    """A class's constructor parameters annotated with int or float: name -> annotation text."""
    init = cls.__init__
    try:
        hints = typing.get_type_hints(init)
    except NameError:
        hints = {}
    out = {}
    for p in inspect.signature(init).parameters.values():
        text = str(hints.get(p.name, p.annotation))
        if p.name != "self" and ("int" in text or "float" in text) and "list[int]" not in text:
            out[p.name] = text
    if issubclass(cls, PolicyGradient):  # its flat keywords: the settings of its parts and groups
        for group in (g for g in {**cls.GROUPS, **cls.PARTS}.values() if g is not None):
            out = {**_numeric_parameters(group), **out}
    return out


def test_the_table_lists_every_numeric_setting():
    """Each class's own numeric parameters (a preset's signature repeats its parts' and groups', and
    a strategy's its base's: those are listed under the class that checks them)."""
    listed = {(cls.__name__, n) for cls, (_, ints, floats) in BUILDERS.items() for n in (*ints, *floats)}
    owners = [*BUILDERS, GRPO, DAPO, PPO]
    missing = []
    for cls in owners:
        own = _numeric_parameters(cls)
        if issubclass(cls, PolicyGradient):  # what its own __init__ names, not the settings it routes to its parts
            code = cls.__init__.__code__
            own = {k: v for k, v in own.items() if k in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]}
        for name in own:
            if name in ("reward_funcs", "reward_weights", "weights") or (cls.__name__, name) in ELSEWHERE:
                continue
            if (cls.__name__, name) not in listed and not any((c.__name__, name) in listed for c in cls.__mro__[1:]):
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"numeric settings not in the table (check them with rltrainer.values): {missing}"


def test_int_rules():
    assert check_int("n", np.int64(3), at_least=1) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_int("max_steps", -1, at_least=1, special={-1: "no limit"}) == -1
    assert check_int("seed", None, none="unseeded") is None
    with pytest.raises(SettingError, match=r"GRPO\(max_new_tokens=...\): max_new_tokens must be an int >= 1 "
                                           r"\(tokens\), got 2.5 \(a float\)\. Write a whole number, e.g\. "
                                           r"max_new_tokens=2 or 3\."):
        check_int("max_new_tokens", 2.5, at_least=1, meaning="tokens", owner="GRPO")
    with pytest.raises(SettingError, match=r"got 2.0 \(a float\)\. Write max_new_tokens=2\."):
        check_int("max_new_tokens", 2.0, at_least=1)
    with pytest.raises(SettingError, match=r"got True \(a bool\)\. True and False are not numbers here"):
        check_int("rows", True, at_least=1)
    with pytest.raises(SettingError, match=r"or -1 \(no limit\), got 0\.$"):
        check_int("max_steps", 0, at_least=1, special={-1: "no limit"})


def test_float_rules():
    assert check_float("lr", 1, above=0) == 1.0 and check_float("lr", np.float32(0.5), above=0) == 0.5
    assert check_float("timeout", math.inf, above=0, finite=False) == math.inf
    with pytest.raises(SettingError, match=r"got inf \(infinity is not allowed here\)"):
        check_float("lr", math.inf, above=0)
    with pytest.raises(SettingError, match=r"top_p must be a number > 0 and <= 1 \(1.0 is off\), got 0\.$"):
        check_float("top_p", 0, above=0, at_most=1, meaning="1.0 is off")
    with pytest.raises(SettingError, match=r"got '1e-5' \(a str\)\. Write the number itself, not a string"):
        check_float("lr", "1e-5", above=0)


def test_max_new_tokens_as_a_float_is_refused_by_grpo_not_by_torch():
    """The issue's case: 2.5 reached generation and failed there as torch's ``full(): argument 'size'``."""
    with pytest.raises(SettingError, match=r"max_new_tokens must be an int >= 1 .*got 2.5 \(a float\)"):
        GRPO("config", TOKENIZER, reward, max_new_tokens=2.5)


@pytest.mark.parametrize("kwargs", [{"batch_size": 2.0}, {"batch_size": True}, {"seed": "0"}])
def test_prompt_dataloader_checks_its_numbers(kwargs):
    with pytest.raises(SettingError, match=rf"prompt_dataloader\({next(iter(kwargs))}=...\)"):
        prompt_dataloader([{"prompt_ids": [1]}] * 4, **{"batch_size": 2, **kwargs})
