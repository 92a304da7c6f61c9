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
from rltrainer.algorithms.parts import Advantage, Critic, DynamicSampling, KLPenalty, PolicyLoss
from rltrainer.modules import CISPO, GSPO, RLOO, DrGRPO, PolicyGradient, ReinforcePlusPlus
from rltrainer.modules.settings import Optimizer
from rltrainer.testing import tiny_qwen2_config

#: The constructor's own arguments, then the groups and parts given whole, then the flat settings.
SIGNATURE = [
    "model", "tokenizer", "reward_funcs", "num_generations", "max_new_tokens", "temperature", "top_p", "top_k",
    "update_epochs", "mini_batch_size", "model_seed", "teacher", "environment", "lora", "optimizer", "rewards", "parts",
    "settings"]
#: Every preset, for the tests that check them all.
PRESETS = (PolicyGradient, GRPO, DAPO, PPO, DrGRPO, GSPO, CISPO, RLOO, ReinforcePlusPlus)


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


def test_every_presets_signature_is_written_out_and_the_same():
    """A preset is parts plus defaults: its signature is PolicyGradient's, written out (what
    ``help()`` shows and the CLI reads), with the groups and parts given whole and the flat
    settings as ``**settings``; the preset's own defaults are on its ``preset`` and its parts."""
    for cls in PRESETS:
        sig = inspect.signature(cls)
        assert list(sig.parameters) == SIGNATURE, cls
        assert sig.parameters["settings"].kind is inspect.Parameter.VAR_KEYWORD
        assert "__init__" not in vars(cls) or cls is PolicyGradient, cls
    assert (make(DAPO, num_generations=None).sampling.n, make(PPO, num_generations=None).sampling.n,
            make(num_generations=None).sampling.n) == (16, 1, 8)
    assert make(DAPO).parts["loss"].clip_ratio_high == 0.28 and make(DrGRPO).parts["advantage"].norm_adv_by_std is False


def test_no_constructor_has_over_twenty_named_parameters():
    for cls in PRESETS:
        assert len(inspect.signature(cls).parameters) <= 20, cls


def test_every_preset_builds_and_its_parts_read_what_some_part_or_hook_adds():
    for cls in PRESETS:
        module = make(cls)
        assert module.parts and all(kind == part.kind for kind, part in module.parts.items()), cls


def test_a_part_whose_input_nothing_provides_is_refused_naming_it():
    """DAPO's group filter reads ``task_scores``, which only the overlong penalty adds."""

    class FilterOnly(PolicyGradient):
        PARTS = {**PolicyGradient.PARTS, "group_filter": DynamicSampling}

    with pytest.raises(ValueError, match=r"FilterOnly: the group_filter part \(DynamicSampling\) reads 'task_scores'"
                                         r", which no part or hook of this module provides\. It could come from an "
                                         r"OverlongPenalty part"):
        make(FilterOnly)
    assert make(FilterOnly, dynamic_sampling=False).parts["group_filter"].dynamic_sampling is False  # reads nothing


@dataclass
class ValueBonus(Part):
    """A user's part that reads a critic's ``values``."""

    kind: ClassVar[str] = "value_bonus"
    reads: ClassVar[tuple[str, ...]] = ("values",)


class NeedsValues(PolicyGradient):
    PARTS = {**PolicyGradient.PARTS, "value_bonus": ValueBonus}


def test_a_users_part_reading_a_field_no_part_adds_is_refused_until_one_does():
    with pytest.raises(ValueError, match=r"NeedsValues: the value_bonus part \(ValueBonus\) reads 'values', which no "
                                         r"part or hook of this module provides\. It could come from a Critic part"):
        make(NeedsValues)
    assert "values" in make(NeedsValues, parts=[Critic()]).compute_stages()  # the critic adds them


def test_parts_given_whole_replace_the_presets_of_their_kind():
    assert make(parts=[KLPenalty(kl_coef=0.1)]).parts["kl"] == KLPenalty(kl_coef=0.1)
    with pytest.raises(TypeError, match=r"GRPO\(parts=...\) got two parts of kind 'kl'"):
        make(parts=[KLPenalty(), KLPenalty()])
    with pytest.raises(TypeError, match=r"of kind 'group_filter', which GRPO has no place for; its kinds: correction"):
        make(parts=[DynamicSampling()])
    with pytest.raises(TypeError, match=r"GRPO\(parts=...\) takes parts .* got 'kl'"):
        make(parts=["kl"])


def test_a_setting_reaches_the_part_that_declares_it():
    module = make(clip_ratio_high=0.28, kl_coef=0.1, lr=1e-5, reward_num_workers=0)
    assert module.parts["loss"].clip_ratio_high == 0.28 and module.parts["kl"].kl_coef == 0.1
    assert module.optimizer_settings.lr == 1e-5
    flat = module.flat_settings()  # read back from the parts, by the same mapping
    assert flat["policy_loss_kwargs"]["clip_ratio_high"] == 0.28 and flat["kl_coef"] == 0.1 and flat["lr"] == 1e-5
    assert not hasattr(module, "kl_coef") and not hasattr(module, "clip_ratio_high")  # one owner: the part
    given = make(parts=[PolicyLoss(clip_ratio_high=0.28), KLPenalty(kl_coef=0.1)], optimizer=Optimizer(lr=1e-5))
    assert given.flat_settings() == flat and given.compute_stages() == module.compute_stages()


def test_an_unknown_setting_names_the_closest_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"GRPO\(\) got an unexpected keyword argument 'clip_ratio_hihg'\. Did you mean "
                                        r"'clip_ratio_high'\? Its arguments: .*kl_coef.*weight_decay"):
        make(clip_ratio_hihg=0.3)
    with pytest.raises(TypeError, match="'critic_lr'"):
        make(critic_lr=1e-4)  # GRPO has no critic part to take it; PPO has
    assert make(PPO, critic_lr=1e-4).parts["critic"].critic_lr == 1e-4


def test_a_part_and_one_of_its_settings_are_refused_together():
    with pytest.raises(TypeError, match=r"got loss=PolicyLoss\(.*\) and its setting\(s\) clip_ratio_high"):
        make(parts=[PolicyLoss()], clip_ratio_high=0.3)
    assert make(parts=[PolicyLoss(clip_ratio_high=0.3)], clip_ratio_high=0.2).parts["loss"].clip_ratio_high == 0.3


@pytest.mark.parametrize("cls, settings", [
    (DrGRPO, {"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    (GSPO, {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}),
    (CISPO, {"policy_loss": "cispo"}),
    (RLOO, {"advantage_estimator": "rloo"}),
    (ReinforcePlusPlus, {"advantage_estimator": "reinforce_plus_plus"}),
])
def test_presets_are_grpo_with_other_settings(cls, settings):
    preset, spelled = make(cls).flat_settings(), make(GRPO, **settings).flat_settings()
    for name in ("policy_loss", "policy_loss_kwargs", "advantage_estimator", "advantage_kwargs", "loss_agg_mode"):
        assert preset[name] == spelled[name], name
    assert make(cls, kl_coef=0.1).parts["kl"].kl_coef == 0.1  # every other setting still applies


@dataclass
class LengthBonus(Part):
    """A user's part: a reward for long responses, added to the loss (``coef`` times the mean
    length in tokens per row, a loss term that is exact under micro-batching)."""

    length_coef: float = 0.0

    kind: ClassVar[str] = "length"
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
    assert LengthAware(tiny_config, bpe_tokenizer, length_reward, parts=[LengthBonus(0.5)]).parts["length"] == (
        LengthBonus(length_coef=0.5))  # given whole (so the CLI: parts: [{class_path: ..., init_args: ...}])
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
                      lr=1e-3, parts=[PolicyLoss("test_reinforce", {"scale": 2.0}),
                                      Advantage("test_max_baseline")])
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
    loss = make(DAPO, dynamic_sampling=False).parts["loss"]
    assert (loss.clip_ratio_high, loss.clip_ratio_c, loss.loss_agg_mode) == (0.28, None, "token-mean")
    given = make(DAPO, dynamic_sampling=False, parts=[PolicyLoss(clip_ratio_high=0.3)]).parts["loss"]
    assert given.params["clip_ratio_high"] == 0.3 and given.params["clip_ratio_c"] == 3.0
