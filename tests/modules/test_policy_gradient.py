"""PolicyGradient is composed of parts: the presets are short, every setting reaches the part that
declares it, and a user adds an algorithm by writing one part (or one registry entry) and nothing
else."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from rltrainer import DAPO, GRPO, PPO, Trainer, prompt_dataloader
from rltrainer.algorithms import ADVANTAGES, POLICY_LOSSES, LossContext
from rltrainer.algorithms.advantages import uses_groups
from rltrainer.algorithms.part import Part, Update
from rltrainer.algorithms.parts import Advantage, Critic, KLPenalty, PolicyLoss
from rltrainer.modules import CISPO, GSPO, RLOO, DrGRPO, PolicyGradient, ReinforcePlusPlus
from rltrainer.testing import tiny_qwen2_config

#: GRPO's arguments before issue 33, in their order (the docs' signature block lists them so).
TODAYS_GRPO = [
    "model", "tokenizer", "reward_funcs", "reward_weights", "reward_num_workers", "reward_timeout", "num_generations",
    "max_new_tokens", "temperature", "top_p", "top_k", "lr", "weight_decay", "warmup_steps", "lr_scheduler_type",
    "lr_scheduler_kwargs", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_coef", "kl_estimator",
    "entropy_coef", "loss_agg_mode", "norm_adv_by_std", "advantage_estimator", "advantage_kwargs", "policy_loss",
    "policy_loss_kwargs", "update_epochs", "mini_batch_size", "rollout_correction", "rollout_correction_kwargs",
    "model_seed", "teacher", "environment", "lora"]


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def length_reward(completions, **kwargs):
    return [min(len(c), 20) / 20 for c in completions]


def make(cls=GRPO, **kwargs):
    return cls(tiny_qwen2_config(vocab_size=64), SimpleNamespace(pad_token_id=0), zero_reward,
               **{"num_generations": 2, **kwargs})


def test_ppo_is_policy_gradient_with_a_critic_not_a_grpo():
    assert not issubclass(PPO, GRPO) and not issubclass(DAPO, GRPO)
    assert all(issubclass(cls, PolicyGradient) for cls in (GRPO, PPO, DAPO, DrGRPO, GSPO, CISPO, RLOO,
                                                           ReinforcePlusPlus))
    ppo = make(PPO)
    assert isinstance(ppo.parts["critic"], Critic) and "critic" not in make().parts
    assert list(make().parts) == ["correction", "advantage", "loss", "kl", "routing"]


def test_the_signature_keeps_every_argument_and_default():
    """Every argument of today's constructors is still there, with its default, where the CLI and
    ``help()`` read it; the parts follow as arguments of their own."""
    grpo = inspect.signature(GRPO).parameters
    assert list(grpo) == TODAYS_GRPO + ["routing_replay", "router_aux_loss_coef", "loss", "advantage", "correction", "kl",
                                        "critic"]
    assert grpo["clip_ratio_high"].default == 0.2 and grpo["lr"].default == 1e-6 and grpo["model_seed"].default == 0
    ppo = inspect.signature(PPO).parameters
    assert (ppo["num_generations"].default, ppo["advantage_estimator"].default, ppo["critic_lr"].default) == (1, "gae",
                                                                                                          1e-5)
    assert set(TODAYS_GRPO) <= set(ppo) and {"gamma", "lam", "kl_in_reward_coef", "vf_coef"} <= set(ppo)
    dapo = inspect.signature(DAPO).parameters
    assert (dapo["clip_ratio_high"].default, dapo["clip_ratio_c"].default, dapo["num_generations"].default) == (
        0.28, None, 16)
    assert inspect.signature(DrGRPO).parameters["norm_adv_by_std"].default is False


def test_no_constructor_has_over_twenty_named_parameters():
    for cls in (PolicyGradient, PPO, DAPO):
        code = cls.__dict__["__init__"].__code__
        assert code.co_argcount + code.co_kwonlyargcount - 1 <= 20, cls


def test_a_setting_reaches_the_part_that_declares_it():
    module = make(clip_ratio_high=0.28, kl_coef=0.1, lr=1e-5, reward_num_workers=0)
    assert module.parts["loss"].clip_ratio_high == 0.28 and module.parts["kl"].kl_coef == 0.1
    assert module.optimizer_settings.lr == 1e-5
    assert module.policy_loss_kwargs["clip_ratio_high"] == 0.28 and module.kl_coef == 0.1  # the flat views
    given = make(loss=PolicyLoss(clip_ratio_high=0.28), kl=KLPenalty(kl_coef=0.1))
    assert given.policy_loss_kwargs == module.policy_loss_kwargs and given.compute_stages() == module.compute_stages()


def test_an_unknown_setting_names_the_closest_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"GRPO\(\) got an unexpected keyword argument 'clip_ratio_hihg'\. Did you mean "
                                        r"'clip_ratio_high'\? Its arguments: .*kl_coef.*weight_decay"):
        make(clip_ratio_hihg=0.3)
    with pytest.raises(TypeError, match="'critic_lr'"):
        make(critic_lr=1e-4)  # GRPO has no critic part to take it; PPO has
    assert make(PPO, critic_lr=1e-4).parts["critic"].critic_lr == 1e-4


def test_a_part_and_one_of_its_settings_are_refused_together():
    with pytest.raises(TypeError, match=r"got loss=PolicyLoss\(.*\) and its setting\(s\) clip_ratio_high"):
        make(loss=PolicyLoss(), clip_ratio_high=0.3)
    assert make(loss=PolicyLoss(clip_ratio_high=0.3), clip_ratio_high=0.2).parts["loss"].clip_ratio_high == 0.3


@pytest.mark.parametrize("cls, settings", [
    (DrGRPO, {"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    (GSPO, {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}),
    (CISPO, {"policy_loss": "cispo"}),
    (RLOO, {"advantage_estimator": "rloo"}),
    (ReinforcePlusPlus, {"advantage_estimator": "reinforce_plus_plus"}),
])
def test_presets_are_grpo_with_other_settings(cls, settings):
    preset, spelled = make(cls), make(GRPO, **settings)
    for name in ("policy_loss", "policy_loss_kwargs", "advantage_estimator", "advantage_kwargs", "loss_agg_mode"):
        assert getattr(preset, name) == getattr(spelled, name), name
    assert make(cls, kl_coef=0.1).kl_coef == 0.1  # every other setting still applies


@dataclass
class LengthBonus(Part):
    """A user's part: a reward for long responses, added to the loss (``coef`` times the mean
    length in tokens per row, a loss term that is exact under micro-batching)."""

    length_coef: float = 0.0

    reads: ClassVar[tuple[str, ...]] = ("response_mask",)

    def update(self, u: Update) -> None:
        if self.length_coef:
            mask = u.micro_batch["response_mask"].to(u.log_probs.dtype)
            term = -self.length_coef * (u.log_probs * mask).sum() / u.counts["global_rows"]
            u.add(term)
            u.metrics["user/length_bonus"] = term.detach()


class LengthAware(PolicyGradient):
    """An algorithm of the user's own: policy gradient plus one part."""

    PARTS = {**PolicyGradient.PARTS, "length": LengthBonus}


def test_a_users_part_is_one_class_and_its_settings_route_to_it(tiny_config, bpe_tokenizer, gsm8k_prompts):
    assert inspect.signature(LengthAware).parameters["length_coef"].default == 0.0  # in the signature, so the CLI
    module = LengthAware(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2,
                         max_new_tokens=6, lr=1e-3, length_coef=0.5)
    assert module.parts["length"] == LengthBonus(length_coef=0.5)
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    m = trainer.callback_metrics
    assert m["user/length_bonus"] > 0 and "actor/pg_loss" in m  # -coef * sum(log p) / rows: the part ran


def test_a_users_registered_loss_and_estimator_train_a_step(tiny_config, bpe_tokenizer, gsm8k_prompts):
    """One registry entry each, chosen by name (or given as the part): nothing else changes."""

    @POLICY_LOSSES.register("test_reinforce", scale=1.0)
    def test_reinforce(log_probs, old_log_probs, advantages, response_mask, ctx: LossContext, *, scale: float):
        return ctx.finish(-scale * advantages * log_probs, response_mask.to(log_probs.dtype)), {
            "actor/test_scale": torch.tensor(scale)}

    @ADVANTAGES.register("test_max_baseline")
    @uses_groups
    def test_max_baseline(scores, response_mask, uids, ctx):
        """Each score minus the best score of its group."""
        best = {u: max(s for s, v in zip(scores.tolist(), uids) if v == u) for u in uids}
        adv = scores - torch.tensor([best[u] for u in uids])
        return adv.unsqueeze(-1) * response_mask, adv.unsqueeze(-1) * response_mask

    try:
        module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=6,
                      lr=1e-3, loss=PolicyLoss("test_reinforce", {"scale": 2.0}),
                      advantage=Advantage("test_max_baseline"))
        trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
        trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
        m = trainer.callback_metrics
        assert m["actor/test_scale"] == pytest.approx(2.0) and m["critic/advantages/mean"] <= 0
        with pytest.raises(ValueError, match="num_generations=1 with advantage_estimator='test_max_baseline'"):
            GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=1,
                 advantage_estimator="test_max_baseline")
    finally:
        for registry, name in ((POLICY_LOSSES, "test_reinforce"), (ADVANTAGES, "test_max_baseline")):
            registry._entries.pop(name)
            registry._descriptions.pop(name)


def test_dapos_loss_settings_are_a_preset_a_given_loss_replaces():
    dapo = make(DAPO, dynamic_sampling=False)
    assert (dapo.clip_ratio_high, dapo.clip_ratio_c, dapo.loss_agg_mode) == (0.28, None, "token-mean")
    given = make(DAPO, dynamic_sampling=False, loss=PolicyLoss(clip_ratio_high=0.3))
    assert given.policy_loss_kwargs["clip_ratio_high"] == 0.3 and given.policy_loss_kwargs["clip_ratio_c"] == 3.0
