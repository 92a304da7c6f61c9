"""Validation metrics mean what their names say: ``val/score`` the mean score, ``val/full_credit`` the
share reaching the module's ``max_score``, ``val/accuracy`` the share right (the rewards that declare
correctness, else full credit), whatever partial credit or a format bonus adds."""

from __future__ import annotations

import functools

import pytest
import torch

from rltrainer import GRPO
from rltrainer.data.batch import RolloutBatch
from rltrainer.module import validation_metrics
from rltrainer.rewards import gsm8k_reward, math_reward


def digits_right(completions, answer, **kwargs):
    """Partial credit: the share of the answer's digits in place."""
    return [sum(x == y for x, y in zip(c.strip(), a)) / len(a) for c, a in zip(completions, answer)]


def starts_with_think(completions, **kwargs):
    return [float(c.startswith("<think>")) for c in completions]


def evaluate(module, texts, **columns):
    batch = module.reward_step(RolloutBatch.from_rows(
        [{"response_text": t, **{k: v[i] for k, v in columns.items()}} for i, t in enumerate(texts)]))
    return validation_metrics(batch["scores"], module.max_score, module.correct_rows(batch))


def grpo(config, tokenizer, rewards, weights=None):
    return GRPO(config, tokenizer, reward_funcs=rewards, reward_weights=weights, num_generations=2)


def test_partial_credit_reward_full_credit_is_exact_match(tiny_config, bpe_tokenizer):
    module = grpo(tiny_config, bpe_tokenizer, digits_right)
    m = evaluate(module, ["321", "329", "999", "1"], answer=["321", "321", "321", "321"])
    # scores 1, 2/3, 0, 0: the old "share above 0" read 50 %; one answer in four is right
    assert m["val/score"] == pytest.approx((1 + 2 / 3) / 4)
    assert m["val/full_credit"] == m["val/accuracy"] == 0.25 and m["val/rows"] == 4


def test_gsm8k_with_a_format_bonus_counts_only_right_answers(tiny_config, bpe_tokenizer):
    lenient = functools.partial(gsm8k_reward, format_score=0.1)
    module = grpo(tiny_config, bpe_tokenizer, lenient)
    m = evaluate(module, ["so #### 5", "so #### 4", "no answer"], ground_truth=["5", "5", "5"])
    assert m["val/score"] == pytest.approx(1.1 / 3)
    assert m["val/accuracy"] == m["val/full_credit"] == pytest.approx(1 / 3)


def test_a_correctness_reward_beside_a_format_reward(tiny_config, bpe_tokenizer):
    module = grpo(tiny_config, bpe_tokenizer, [math_reward, starts_with_think], weights=[1.0, 0.2])
    assert module.max_score == pytest.approx(1.2)
    texts = ["<think>ok</think> \\boxed{2}", "\\boxed{2}", "<think>hm</think> \\boxed{3}", "none"]
    m = evaluate(module, texts, ground_truth=["2"] * 4)
    assert m["val/accuracy"] == 0.5  # both right answers, with or without the format term
    assert m["val/full_credit"] == 0.25  # only the right one in the format reaches 1.2
    assert m["val/score"] == pytest.approx((1.2 + 1.0 + 0.2) / 4)


def test_a_partial_sets_its_own_max_score(tiny_config, bpe_tokenizer):
    double = functools.partial(gsm8k_reward, correct_score=2.0)
    double.max_score = 2.0
    module = grpo(tiny_config, bpe_tokenizer, double)
    m = evaluate(module, ["#### 5", "#### 6"], ground_truth=["5", "5"])
    assert module.max_score == 2.0 and m["val/accuracy"] == m["val/full_credit"] == 0.5


def test_validation_metrics_without_correctness():
    m = validation_metrics(torch.tensor([0.5, 1.0, 0.999_999_5]), 1.0, None)
    assert m["val/full_credit"] == m["val/accuracy"] == pytest.approx(2 / 3)
    m = validation_metrics(torch.tensor([0.5, 1.0]), 1.0, torch.tensor([True, True]))
    assert m["val/accuracy"] == 1.0 and m["val/full_credit"] == 0.5
