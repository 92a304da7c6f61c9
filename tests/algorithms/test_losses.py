"""PPO clipped surrogate and clipped value loss on hand-made 1xT examples.

Per token: ``max(-A * r, -A * clip(r, 1 - low, 1 + high))``, then for ``A < 0`` at most ``-A * c``.
Log-probs are built as ``old + log(ratio)`` so each ratio is chosen exactly.
"""

import math

import pytest
import torch

from rltrainer.algorithms import POLICY_LOSSES, LossContext, clipped_value_loss, ppo_clip_loss


def make(ratios: list[float], advantages: list[float], mask: list[int] | None = None,
         old: list[float] | None = None) -> dict[str, torch.Tensor]:
    old_t = torch.tensor([old if old is not None else [-1.0] * len(ratios)])
    return {
        "log_probs": old_t + torch.log(torch.tensor([ratios])),
        "old_log_probs": old_t,
        "advantages": torch.tensor([advantages]),
        "response_mask": torch.tensor([mask if mask is not None else [1] * len(ratios)]),
    }


def test_registered_as_ppo_clip() -> None:
    assert POLICY_LOSSES.get("ppo_clip") is ppo_clip_loss


def test_inside_the_clip_range_is_minus_a_times_ratio() -> None:
    loss, metrics = ppo_clip_loss(**make([1.1, 0.9, 1.0], [2.0, -1.0, 0.5]))
    # -2*1.1 = -2.2;  1*0.9 = 0.9;  -0.5*1 = -0.5;  token mean -1.8 / 3
    torch.testing.assert_close(loss, torch.tensor(-0.6))
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_ratio_above_range_positive_advantage_is_clipped() -> None:
    loss, metrics = ppo_clip_loss(**make([1.5, 1.0], [1.0, 1.0]))
    # token 0: max(-1.5, -1.2) = -1.2 (clipped);  token 1: -1.0;  mean -1.1
    torch.testing.assert_close(loss, torch.tensor(-1.1))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.5))


def test_ratio_below_range_negative_advantage_is_clipped() -> None:
    loss, metrics = ppo_clip_loss(**make([0.5], [-1.0]))
    # max(1 * 0.5, 1 * 0.8) = 0.8
    torch.testing.assert_close(loss, torch.tensor(0.8))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(1.0))


def test_pessimistic_side_is_not_clipped() -> None:
    # A > 0 with small ratio, A < 0 with moderately large ratio: the unclipped term is larger
    loss, metrics = ppo_clip_loss(**make([0.5, 1.5], [1.0, -1.0]))
    # max(-0.5, -0.8) = -0.5;  max(1.5, 1.2) = 1.5 (below the dual-clip cap 3);  mean 0.5
    torch.testing.assert_close(loss, torch.tensor(0.5))
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_asymmetric_clip_range() -> None:
    batch = make([1.25, 0.85], [1.0, -2.0])
    # clip-higher 0.28: 1.25 is inside -> -1.25;  low 0.1: 0.85 -> 0.9 -> max(1.7, 1.8) = 1.8;  mean 0.275
    loss, metrics = ppo_clip_loss(**batch, clip_ratio_low=0.1, clip_ratio_high=0.28)
    torch.testing.assert_close(loss, torch.tensor(0.275))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.5))  # the second token
    # symmetric 0.2: 1.25 -> 1.2 -> -1.2;  0.85 is inside -> 1.7;  mean 0.25
    loss, metrics = ppo_clip_loss(**batch)
    torch.testing.assert_close(loss, torch.tensor(0.25))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.5))  # the first token


def test_dual_clip_caps_negative_advantage() -> None:
    batch = make([5.0, 10.0, 1.0], [-1.0, -2.0, 1.0])
    loss, metrics = ppo_clip_loss(**batch, clip_ratio_c=3.0)
    # token 0: max(5, 1.2) = 5 -> capped at 1*3 = 3;  token 1: max(20, 2.4) = 20 -> capped at 2*3 = 6
    # token 2: -1;  mean (3 + 6 - 1) / 3
    torch.testing.assert_close(loss, torch.tensor(8.0 / 3.0))
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(2.0 / 3.0))
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    # None disables the cap: (5 + 20 - 1) / 3 = 8
    loss, metrics = ppo_clip_loss(**batch, clip_ratio_c=None)
    torch.testing.assert_close(loss, torch.tensor(8.0))
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_dual_clip_does_not_touch_positive_advantages() -> None:
    # A > 0 with a huge ratio: clipped at 1 + high regardless of the cap
    loss, _ = ppo_clip_loss(**make([50.0], [2.0]), clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor(-2.4))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_clip_ratio_c_must_exceed_one(c: float) -> None:
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip_loss(**make([1.0], [1.0]), clip_ratio_c=c)


def test_ppo_kl_metric_is_mean_old_minus_new() -> None:
    log_probs = torch.tensor([[0.0, 0.1, 0.5]])
    old = torch.tensor([[0.1, -0.2, 0.3]])
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = ppo_clip_loss(log_probs, old, torch.ones(1, 3), mask)
    # ((0.1 - 0.0) + (-0.2 - 0.1)) / 2 tokens
    torch.testing.assert_close(metrics["actor/ppo_kl"], torch.tensor(-0.1))


def test_masking_and_global_tokens() -> None:
    batch = make([1.1, 1.0, 100.0], [2.0, 1.0, -5.0], mask=[1, 1, 0])
    loss, metrics = ppo_clip_loss(**batch)
    torch.testing.assert_close(loss, torch.tensor((-2.2 - 1.0) / 2))  # the padded token is ignored
    loss, metrics = ppo_clip_loss(**batch, ctx=LossContext(global_tokens=8.0))
    torch.testing.assert_close(loss, torch.tensor((-2.2 - 1.0) / 8))
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_loss_agg_mode_is_passed_through() -> None:
    log_probs = torch.zeros(2, 2)  # ratio 1 everywhere: loss = -A
    adv = torch.tensor([[1.0, 3.0], [4.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = ppo_clip_loss(log_probs, log_probs, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(-8.0 / 3.0))  # token-mean: -(1 + 3 + 4) / 3
    loss, _ = ppo_clip_loss(log_probs, log_probs, adv, mask, ctx=LossContext("seq-mean-token-mean"))
    torch.testing.assert_close(loss, torch.tensor(-3.0))  # row means -2 and -4
    loss, _ = ppo_clip_loss(log_probs, log_probs, adv, mask, ctx=LossContext("seq-mean-token-sum"))
    torch.testing.assert_close(loss, torch.tensor(-4.0))  # row sums -4 and -4, over 2 rows


def test_gradient_is_minus_a_ratio_over_tokens_for_unclipped_only() -> None:
    ratios = [1.1, 1.5, 0.5, 5.0, 0.5, 1.5, 2.0]
    advs = [2.0, 1.0, -1.0, -1.0, 1.0, -1.0, 3.0]
    # unclipped, clipped high, clipped low, dual clipped, pessimistic A>0, pessimistic A<0, padding
    batch = make(ratios, advs, mask=[1, 1, 1, 1, 1, 1, 0], old=[-0.5, -1.0, -2.0, -3.0, -0.1, -0.7, -1.0])
    log_probs = batch.pop("log_probs").requires_grad_(True)
    global_tokens = 10.0
    loss, metrics = ppo_clip_loss(log_probs, **batch, ctx=LossContext(global_tokens=global_tokens))
    loss.backward()
    # d(-A * exp(logp - old)) / d logp = -A * ratio, divided by the global token count
    expected = torch.tensor([[-2.0 * 1.1, 0.0, 0.0, 0.0, -1.0 * 0.5, 1.0 * 1.5, 0.0]]) / global_tokens
    torch.testing.assert_close(log_probs.grad, expected)
    # value: (-2.2 - 1.2 + 0.8 + 3.0 - 0.5 + 1.5) / 10
    torch.testing.assert_close(loss, torch.tensor(0.14))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.2))  # 2 of 10
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(0.1))  # 1 of 10
    # ppo_kl: -sum(log ratio) over the 6 real tokens / 10
    kl = -(math.log(1.1) + math.log(1.5) + math.log(0.5) + math.log(5.0) + math.log(0.5) + math.log(1.5)) / 10
    torch.testing.assert_close(metrics["actor/ppo_kl"], torch.tensor(kl))
    assert all(not v.requires_grad for v in metrics.values())


def test_clipped_value_loss_by_hand() -> None:
    values = torch.tensor([[1.0, 0.0, 2.0, 3.0, 9.0]])
    old_values = torch.tensor([[0.5, 0.2, 2.0, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = clipped_value_loss(values, old_values, returns, mask, clip_range=0.2)
    # token 0: V clipped to 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845     (clipped term larger)
    # token 1: V - V_old = -0.2 is inside: (0-1)^2 = 1 -> 0.5
    # token 2: (2-0)^2 = 4 -> 2.0
    # token 3: V clipped to 2.2: max(0, 0.64) = 0.64 -> 0.32                (clipped term larger)
    # token 4: padding
    torch.testing.assert_close(loss, torch.tensor((0.845 + 0.5 + 2.0 + 0.32) / 4))
    torch.testing.assert_close(metrics["critic/vf_clipfrac"], torch.tensor(0.5))


def test_clipped_value_loss_unclipped_term_wins() -> None:
    # V moved beyond the range but away from the return: the unclipped error is larger
    loss, metrics = clipped_value_loss(torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                                       torch.ones(1, 1), clip_range=0.5)
    # max((0-2)^2, (0.5-2)^2) = 4 -> 2
    torch.testing.assert_close(loss, torch.tensor(2.0))
    assert metrics["critic/vf_clipfrac"].item() == 0.0
