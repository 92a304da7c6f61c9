"""GRPO and PPO choose their policy loss and advantage estimator by name from the registries, with
each entry's own parameters; what cannot work is refused at construction, saying what was given,
what is allowed and how to fix it."""

from types import SimpleNamespace

import pytest
import torch

from rltrainer import GRPO, PPO
from rltrainer.algorithms import ADVANTAGES, POLICY_LOSSES, AdvantageContext
from rltrainer.data.batch import RolloutBatch
from rltrainer.rollout.engine import Generation, SamplingParams
from rltrainer.testing import tiny_qwen2_config


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def grpo(**kwargs) -> GRPO:
    return GRPO(tiny_qwen2_config(vocab_size=64), SimpleNamespace(pad_token_id=0), zero_reward, num_generations=2,
                **kwargs)


def test_defaults_are_todays_ppo_clip_and_grpo() -> None:
    module = grpo()
    assert module.parts["loss"].policy_loss == "ppo_clip" and module.parts["advantage"].advantage_estimator == "grpo"
    assert module.parts["loss"].params == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    assert module.parts["advantage"].params == {"norm_by_std": True, "epsilon": 1e-6}
    assert module.compute_stages() == []


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="Unknown policy loss 'ppo'.*cispo, clip_cov, dppo_kl, dppo_tv, gspo"):
        grpo(policy_loss="ppo")
    with pytest.raises(ValueError, match="Unknown advantage estimator 'rf'.*reinforce_plus_plus"):
        grpo(advantage_estimator="rf")


def test_unknown_parameter_lists_the_entrys_parameters() -> None:
    with pytest.raises(ValueError, match=r"Policy loss 'sapo' has no parameter\(s\) tau\. "
                                         r"Its parameters \(with defaults\): tau_pos=1.0, tau_neg=1.05"):
        grpo(policy_loss="sapo", policy_loss_kwargs={"tau": 2.0})
    with pytest.raises(ValueError, match=r"Advantage estimator 'rloo' has no parameter\(s\) epsilon.*none"):
        grpo(advantage_estimator="rloo", advantage_kwargs={"epsilon": 0.1})


@pytest.mark.parametrize("name, kwargs, message", [
    ("sapo", {"tau_neg": 0.0}, "tau_neg must be a number > 0, got 0.0"),
    ("cispo", {"clip_ratio_high": -1.0}, "clip_ratio_high >= 0"),
    ("gspo", {"clip_ratio_low": 1.5}, r"clip_ratio_low in \[0, 1\)"),
    ("ppo_clip", {"clip_ratio_c": 0.5}, "clip_ratio_c must be > 1"),
    ("clip_cov", {"clip_cov_ratio": 0}, "clip_cov_ratio must be a number > 0"),
    ("dppo_tv", {"clip_ratio_high": "0.2"}, "clip_ratio_high must be a number > 0"),
])
def test_bad_loss_values_are_refused(name, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        grpo(policy_loss=name, policy_loss_kwargs=kwargs)


def test_bad_estimator_values_are_refused() -> None:
    with pytest.raises(ValueError, match="gamma must be a number >= 0"):
        grpo(advantage_estimator="reinforce_plus_plus", advantage_kwargs={"gamma": -1})
    with pytest.raises(ValueError, match="Unknown KL estimator 'k9'"):
        grpo(advantage_estimator="reinforce_plus_plus", advantage_kwargs={"kl_estimator": "k9"})


def test_shorthands_map_onto_the_entrys_parameters() -> None:
    assert grpo(clip_ratio_high=0.28).parts["loss"].params["clip_ratio_high"] == 0.28  # DAPO's clip-higher
    assert grpo(clip_ratio_c=None).parts["loss"].params["clip_ratio_c"] is None
    # left at their defaults, they leave the entry's own (GSPO's clip range is 3e-4, 4e-4)
    assert grpo(policy_loss="gspo").parts["loss"].params == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert grpo(policy_loss="gspo", clip_ratio_high=1e-3).parts["loss"].params["clip_ratio_high"] == 1e-3
    assert grpo(norm_adv_by_std=False).parts["advantage"].params["norm_by_std"] is False  # Dr. GRPO
    assert grpo(advantage_estimator="dr_grpo").parts["advantage"].params["norm_by_std"] is False
    # the same value twice is not a conflict
    assert grpo(clip_ratio_high=0.28, policy_loss_kwargs={"clip_ratio_high": 0.28}).parts["loss"].params[
        "clip_ratio_high"] == 0.28


def test_conflicting_or_inapplicable_shorthands_are_refused() -> None:
    with pytest.raises(ValueError, match=r"clip_ratio_high is set twice: clip_ratio_high=0.28 and "
                                         r"policy_loss_kwargs\['clip_ratio_high'\]=0.3"):
        grpo(clip_ratio_high=0.28, policy_loss_kwargs={"clip_ratio_high": 0.3})
    with pytest.raises(ValueError, match="clip_ratio_c=None does not apply to policy loss 'sapo' "
                                         r"\(its parameters: tau_pos=1.0, tau_neg=1.05\)"):
        grpo(policy_loss="sapo", clip_ratio_c=None)
    with pytest.raises(ValueError, match="norm_adv_by_std=False does not apply to advantage estimator 'rloo'"):
        grpo(advantage_estimator="rloo", norm_adv_by_std=False)
    with pytest.raises(ValueError, match="norm_by_std is set twice"):
        grpo(norm_adv_by_std=False, advantage_kwargs={"norm_by_std": True})


def test_an_estimator_that_needs_a_critic_is_refused_and_points_to_ppo() -> None:
    with pytest.raises(ValueError, match=r"advantage_estimator='gae' needs a critic's values \[N, T\], and GRPO "
                                         r"trains no critic\. Use rltrainer\.PPO.*critic-free estimator: dr_grpo, "
                                         r"grpo, opo"):
        grpo(advantage_estimator="gae")


def test_ppo_composes_the_same_pieces_with_a_critic(tiny_config, bpe_tokenizer) -> None:
    module = PPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, gamma=0.9, lam=0.8, kl_in_reward_coef=0.05)
    assert module.parts["advantage"].advantage_estimator == "gae"
    assert module.parts["advantage"].params == {"gamma": 0.9, "lam": 0.8, "whiten": True, "kl_in_reward_coef": 0.05,
                                       "kl_estimator": "k1"}
    assert module.compute_stages() == ["old_log_prob", "ref", "values"]  # the KL in the reward needs both
    plain = PPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward)
    assert plain.compute_stages() == ["values"] and not plain.needs_ref()
    critic_grpo = PPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, advantage_estimator="grpo",
                      policy_loss="cispo", num_generations=2)  # grpo needs groups: G=1 is refused
    with pytest.raises(ValueError, match="num_generations=1 with advantage_estimator='grpo'"):
        PPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, advantage_estimator="grpo")
    assert critic_grpo.compute_stages() == ["values"]
    with pytest.raises(ValueError, match="lam=0.5 does not apply to advantage estimator 'grpo'"):
        PPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, advantage_estimator="grpo", lam=0.5)
    with pytest.raises(ValueError, match="gamma is set twice"):
        PPO(tiny_config, bpe_tokenizer, reward_funcs=zero_reward, gamma=0.9, advantage_kwargs={"gamma": 0.5})


def test_stages_follow_what_the_entries_need() -> None:
    # a KL penalty in the token rewards needs the old and the reference log-probs on the controller
    module = grpo(advantage_estimator="reinforce_plus_plus", advantage_kwargs={"kl_in_reward_coef": 0.01})
    assert module.compute_stages() == ["old_log_prob", "ref"] and module.needs_ref()
    module.configure_model()
    assert module.ref_policy is not None
    # a loss selecting tokens from the whole batch needs the old log-probs before the update
    assert grpo(policy_loss="clip_cov").compute_stages() == ["old_log_prob"]
    assert grpo(policy_loss="gspo").compute_stages() == []


def fake_batch(n: int = 4, t: int = 3) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(n, t, dtype=torch.long)
    old = -torch.rand(n, t, generator=gen)
    return RolloutBatch({"scores": torch.tensor([1.0, 0.0, 1.0, 0.5]), "response_mask": mask,
                         "responses": torch.arange(n * t).reshape(n, t), "old_log_probs": old,
                         "ref_log_probs": old + 0.1}, {"uid": ["a", "a", "b", "b"]})


def test_advantage_step_calls_the_estimator_with_its_context() -> None:
    module = grpo(advantage_estimator="reinforce_plus_plus", advantage_kwargs={"kl_in_reward_coef": 0.5})
    batch = module.advantage_step(fake_batch())
    ctx = AdvantageContext(old_log_probs=batch["old_log_probs"], ref_log_probs=batch["ref_log_probs"])
    expected, _ = ADVANTAGES.build("reinforce_plus_plus", scores=batch["scores"], response_mask=batch["response_mask"],
                                   uids=batch["uid"], ctx=ctx, gamma=1.0, kl_in_reward_coef=0.5, kl_estimator="k1")
    torch.testing.assert_close(batch["advantages"], expected)
    missing = fake_batch().select("scores", "response_mask", "responses", "old_log_probs", "uid")
    with pytest.raises(KeyError, match=r"needs \['ref_log_probs'\]"):
        module.advantage_step(missing)


def test_advantage_step_runs_the_losss_batch_level_selection() -> None:
    module = grpo(policy_loss="kl_cov", policy_loss_kwargs={"kl_cov_ratio": 0.25})
    batch = module.advantage_step(fake_batch())
    assert batch.loss_extras == ["cov_selected"]
    assert batch["cov_selected"].sum() == 3  # a quarter of 12 tokens
    assert all(part["cov_selected"].shape == (2, 3) for part in batch.split(2))  # travels with micro-batches


def test_a_users_loss_is_registered_and_chosen_by_name() -> None:
    """The README's example: register a loss with its parameters, choose it by name."""
    from rltrainer.algorithms import LossContext

    @POLICY_LOSSES.register("scaled_pg", scale=1.0)
    def scaled_pg(log_probs, old_log_probs, advantages, response_mask, ctx: LossContext, *, scale: float):
        return ctx.finish(-scale * advantages * log_probs, response_mask.to(log_probs.dtype)), {}

    try:
        module = grpo(policy_loss="scaled_pg", policy_loss_kwargs={"scale": 2.0})
        assert module.parts["loss"].params == {"scale": 2.0}
        with pytest.raises(ValueError, match="has no parameter"):
            grpo(policy_loss="scaled_pg", policy_loss_kwargs={"scal": 2.0})
    finally:
        POLICY_LOSSES._entries.pop("scaled_pg")
        POLICY_LOSSES._descriptions.pop("scaled_pg")


class GreedyAwareEngine:
    """A fake engine: sampled responses are "s<j>" (j-th sample), greedy ones "greedy"; it records
    every request's sampling parameters."""

    weight_version = 0

    def __init__(self) -> None:
        self.requests: list[SamplingParams] = []

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Generation:
        self.requests.append(sampling)
        rows = len(prompts) * sampling.n
        text = ["greedy" if sampling.temperature == 0 else f"s{j}" for _ in prompts for j in range(sampling.n)]
        ids = torch.ones(rows, 2, dtype=torch.long)
        return Generation(ids, torch.ones(rows, 2, dtype=torch.long), torch.zeros(rows, 2), text, ["stop"] * rows)


def test_remax_rollout_issues_a_greedy_generation_and_uses_its_reward_as_baseline() -> None:
    def reward(completions, answer, **kwargs):  # "greedy" scores the prompt's answer, sample j scores j
        return [float(a) if c == "greedy" else float(c[1:]) for c, a in zip(completions, answer, strict=True)]

    module = GRPO(tiny_qwen2_config(vocab_size=64), SimpleNamespace(pad_token_id=0), reward, num_generations=3,
                  advantage_estimator="remax")
    assert module.compute_stages() == []
    engine = GreedyAwareEngine()
    prompts = RolloutBatch(non_tensors={"prompt_ids": [[5, 6], [7]], "answer": ["1", "2"]})
    batch = module.rollout_step(prompts, engine)
    assert [(r.n, r.temperature) for r in engine.requests] == [(3, 1.0), (1, 0.0)]  # the sampled, then the greedy
    assert list(batch["baseline_response_text"]) == ["greedy"] * 6
    batch = module.advantage_step(module.reward_step(batch))
    torch.testing.assert_close(batch["reward_baselines"], torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
    # scores 0, 1, 2 per group minus the greedy score, on every response token
    expected = torch.tensor([-1.0, 0.0, 1.0, -2.0, -1.0, 0.0]).unsqueeze(-1).expand(6, 2)
    torch.testing.assert_close(batch["advantages"], expected)


@pytest.mark.parametrize("estimator, advantage_kwargs, loss, loss_kwargs", [
    ("reinforce_plus_plus", {"kl_in_reward_coef": 0.05}, "clip_cov", {"clip_cov_ratio": 0.5, "clip_cov_lb": -1.0}),
    ("remax", {}, "gspo", {}),
])
def test_entries_run_through_the_trainer(estimator, advantage_kwargs, loss, loss_kwargs, tiny_config, bpe_tokenizer,
                                         gsm8k_prompts) -> None:
    """One real step: the stages each entry needs run, the batch-level selection reaches the
    update, the greedy baseline is generated and scored."""
    from rltrainer import Trainer, prompt_dataloader

    def length_reward(completions, **kwargs):
        return [min(len(c), 20) / 20 for c in completions]

    module = GRPO(tiny_config, bpe_tokenizer, reward_funcs=length_reward, num_generations=2, max_new_tokens=8,
                  lr=1e-3, advantage_estimator=estimator, advantage_kwargs=advantage_kwargs, policy_loss=loss,
                  policy_loss_kwargs=loss_kwargs)
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    m = trainer.callback_metrics
    assert "actor/pg_loss" in m and torch.isfinite(torch.tensor(m["actor/pg_loss"]))
    if estimator == "reinforce_plus_plus":
        assert {"timing_s/old_log_prob", "timing_s/ref", "critic/kl_in_reward"} <= set(m)
        assert m["actor/pg_clipfrac"] > 0  # clip_cov cut some tokens in the update
    else:
        assert "critic/reward_baseline/mean" in m and "timing_s/old_log_prob" not in m
