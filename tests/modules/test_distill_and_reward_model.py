"""On-policy distillation (a frozen teacher's reverse-KL term on the advantages) and a
sequence-classification reward model mixed with rule rewards, both as compute stages."""

from __future__ import annotations

import math

import pytest
import torch

from rltrainer import DAPO, GRPO, PPO, RewardModel, Teacher, Trainer, prompt_dataloader
from rltrainer.algorithms import ADVANTAGES, AdvantageContext
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import response_log_probs
from rltrainer.strategies import SingleDeviceStrategy
from rltrainer.testing import length_reward, prepared_batch, tiny_qwen2_config


def make(tokenizer, config, **kwargs):
    defaults = dict(reward_funcs=length_reward, num_generations=4, max_new_tokens=8, lr=1e-3)
    return GRPO(config, tokenizer, **{**defaults, **kwargs})


def batch_for(module, prompts, seed=7):
    strategy = SingleDeviceStrategy(device="cpu", micro_batch_size=3)  # 12 rows: several micro-batches
    strategy.setup(module, seed=seed)
    torch.manual_seed(0)
    return strategy, prepared_batch(module, strategy, prompts)


@pytest.fixture
def prompts(gsm8k_prompts):
    return RolloutBatch.from_rows([gsm8k_prompts[i] for i in range(3)])


def test_teacher_stage_and_distilled_advantages_follow_the_formula(tiny_config, bpe_tokenizer, prompts):
    teacher_config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=48, num_layers=1)  # another model
    module = make(bpe_tokenizer, tiny_config, teacher=Teacher(teacher_config, coef=0.5, seed=11))
    assert module.compute_stages() == ["old_log_prob", "teacher"]  # old log-probs needed on the controller
    _, batch = batch_for(module, prompts)
    temperature = batch.temperature
    with torch.no_grad():  # the stage equals the teacher's log-probs computed by hand, on the whole batch
        by_hand = response_log_probs(module.teacher, batch, temperature)[0]
    torch.testing.assert_close(batch["teacher_log_probs"], by_hand, rtol=0, atol=1e-6)
    assert not any(p.requires_grad for p in module.teacher.parameters()) and not module.teacher.training
    mask = batch["response_mask"]
    estimator, _ = ADVANTAGES.get("grpo")(batch["scores"], mask, batch["uid"], AdvantageContext(),
                                          **module.parts["advantage"].params)
    expected = estimator - 0.5 * (batch["old_log_probs"] - batch["teacher_log_probs"]) * mask
    torch.testing.assert_close(batch["advantages"], expected, rtol=0, atol=1e-6)
    assert (batch["advantages"] - estimator).abs().sum() > 0.1  # the term is really there
    reverse_kl = ((batch["old_log_probs"] - batch["teacher_log_probs"]) * mask).sum() / mask.sum()
    assert module.logged_metrics["distill/reverse_kl/mean"] == pytest.approx(reverse_kl.item(), abs=1e-6)


def test_a_teacher_equal_to_the_policy_adds_nothing(tiny_config, bpe_tokenizer, prompts):
    module = make(bpe_tokenizer, tiny_config, teacher=Teacher(tiny_config, coef=2.0, seed=0))  # model_seed=0
    _, batch = batch_for(module, prompts)
    torch.testing.assert_close(batch["teacher_log_probs"], batch["old_log_probs"], rtol=0, atol=1e-6)
    assert module.logged_metrics["distill/reverse_kl/mean"] == pytest.approx(0.0, abs=1e-6)
    plain, _ = ADVANTAGES.get("grpo")(batch["scores"], batch["response_mask"], batch["uid"], AdvantageContext(),
                                      **module.parts["advantage"].params)
    torch.testing.assert_close(batch["advantages"], plain, rtol=0, atol=1e-5)


def test_distillation_alone_trains(tiny_config, bpe_tokenizer, gsm8k_prompts):
    teacher_config = tiny_qwen2_config(len(bpe_tokenizer), hidden_size=48, num_layers=1)
    module = make(bpe_tokenizer, tiny_config, reward_funcs=None, teacher=Teacher(teacher_config, seed=11))
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    m = trainer.callback_metrics
    assert m["critic/score/mean"] == 0.0  # no reward: the advantages are the teacher term alone
    for key in ("actor/pg_loss", "distill/reverse_kl/mean", "timing_s/teacher", "critic/advantages/mean"):
        assert key in m and math.isfinite(m[key]), key
    assert m["actor/grad_norm"] > 0  # with zero scores and no teacher the advantages, and the gradient, are 0
    assert GRPO(tiny_config, bpe_tokenizer, reward_funcs=[], teacher=Teacher(tiny_config)).rewards is None
    ppo = PPO(tiny_config, bpe_tokenizer, reward_funcs=None, teacher=Teacher(tiny_config))  # any estimator: GAE too
    assert ppo.compute_stages() == ["old_log_prob", "teacher", "values"]


def test_teacher_vocabularies_are_checked(tiny_config, bpe_tokenizer, qwen_tokenizer):
    with pytest.raises(ValueError, match="teacher's tokenizer differs from the policy's"):
        make(bpe_tokenizer, tiny_config, teacher=Teacher(tiny_config, tokenizer=qwen_tokenizer))
    bigger = tiny_qwen2_config(len(bpe_tokenizer) + 64, hidden_size=32, num_layers=1)
    module = make(bpe_tokenizer, tiny_config, teacher=Teacher(bigger))
    with pytest.raises(ValueError, match=r"teacher's vocab_size is \d+, the policy's \d+.*tokenizer=teacher_tokenizer"):
        module.configure_model()
    make(bpe_tokenizer, tiny_config, teacher=Teacher(bigger, tokenizer=bpe_tokenizer)).configure_model()  # padding
    smaller = tiny_qwen2_config(len(bpe_tokenizer) - 1, hidden_size=32, num_layers=1)
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        make(bpe_tokenizer, tiny_config, teacher=Teacher(smaller, tokenizer=bpe_tokenizer)).configure_model()
    with pytest.raises(ValueError, match="no reward .* and no teacher"):
        make(bpe_tokenizer, tiny_config, reward_funcs=None)
    with pytest.raises(TypeError, match="teacher must be a rltrainer.algorithms.distill.Teacher"):
        make(bpe_tokenizer, tiny_config, teacher=tiny_config)


def rm_config(tokenizer):
    return tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1)


def test_reward_model_stage_equals_transformers_and_mixes_by_weight(tiny_config, bpe_tokenizer, prompts):
    from transformers import AutoModelForSequenceClassification

    module = make(bpe_tokenizer, tiny_config, reward_funcs=[length_reward, RewardModel(rm_config(bpe_tokenizer), seed=5)],
                  reward_weights=[2.0, 0.5])
    assert module.compute_stages() == ["reward_model"]
    _, batch = batch_for(module, prompts)
    # the same sequences through a plain transformers model with the same weights, in one call
    torch.manual_seed(5)
    config = rm_config(bpe_tokenizer)
    config.num_labels, config.pad_token_id = 1, bpe_tokenizer.pad_token_id
    direct = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        expected = direct(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"]).logits[:, 0]
    torch.testing.assert_close(batch["rm_scores"], expected, rtol=0, atol=1e-5)
    assert batch["rm_scores"].std() > 0  # rows really differ
    rule = torch.tensor(length_reward(list(batch["response_text"])))
    torch.testing.assert_close(batch["scores"], 2.0 * rule + 0.5 * expected, rtol=0, atol=1e-5)
    assert module.logged_metrics["reward_model/score/mean"] == pytest.approx(expected.mean().item(), abs=1e-5)
    assert module.logged_metrics["critic/score/mean"] == pytest.approx(batch["scores"].mean().item(), abs=1e-5)


def test_reward_model_alone_trains_and_bad_specs_are_refused(tiny_config, bpe_tokenizer, gsm8k_prompts):
    module = make(bpe_tokenizer, tiny_config, reward_funcs=RewardModel(rm_config(bpe_tokenizer)))
    trainer = Trainer(max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(module, prompt_dataloader(gsm8k_prompts, batch_size=2))
    assert math.isfinite(trainer.callback_metrics["reward_model/score/mean"])
    assert "timing_s/reward_model" in trainer.callback_metrics
    two = [RewardModel(rm_config(bpe_tokenizer)), RewardModel(rm_config(bpe_tokenizer))]
    with pytest.raises(ValueError, match="2 RewardModel entries; one reward model is supported"):
        make(bpe_tokenizer, tiny_config, reward_funcs=two)
    with pytest.raises(ValueError, match="Got 1 reward_weights for 2 reward_funcs"):
        make(bpe_tokenizer, tiny_config, reward_funcs=[length_reward, two[0]], reward_weights=[1.0])
    with pytest.raises(ValueError, match="dynamic sampling filters groups"):
        DAPO(tiny_config, bpe_tokenizer, reward_funcs=[length_reward, two[0]])
    with pytest.raises(ValueError, match="greedy baseline"):
        make(bpe_tokenizer, tiny_config, reward_funcs=[length_reward, two[0]], advantage_estimator="remax")
