"""Advantage estimators against values worked out by hand (closed form written in each test)."""

import math

import pytest
import torch

from rltrainer.algorithms import ADVANTAGES, gae_advantages, grpo_advantages, rloo_advantages
from rltrainer.algorithms.advantages import group_index

# Two groups of four, interleaved so that grouping is by uid and not by position:
#   group "a": scores 1, 0, 0, 1  -> mean 0.5,  unbiased var (4 * 0.25) / 3 = 1/3, std 1/sqrt(3)
#   group "b": scores 1, 1, 1, 0  -> mean 0.75, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5
UIDS = ["a", "b", "a", "b", "a", "b", "a", "b"]
SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
SQRT3 = math.sqrt(3.0)


def full_mask(n: int, t: int = 3) -> torch.Tensor:
    return torch.ones(n, t)


def test_group_index_maps_any_hashable_to_consecutive_ints() -> None:
    assert group_index(["x", "y", "x", 7]).tolist() == [1, 2, 1, 0]


def test_grpo_mean_and_unbiased_std() -> None:
    adv, returns = grpo_advantages(SCORES, full_mask(8), UIDS, epsilon=0.0)
    # a: (1 - 0.5) / (1/sqrt(3)) = +sqrt(3)/2, (0 - 0.5) * sqrt(3) = -sqrt(3)/2
    # b: (1 - 0.75) / 0.5 = 0.5, (0 - 0.75) / 0.5 = -1.5
    h = SQRT3 / 2
    expected = torch.tensor([h, 0.5, -h, 0.5, -h, 0.5, h, -1.5])
    torch.testing.assert_close(adv, expected.unsqueeze(-1).expand(8, 3))
    torch.testing.assert_close(returns, adv)
    assert adv.dtype == torch.float32


def test_grpo_default_epsilon_is_added_to_the_std() -> None:
    adv, _ = grpo_advantages(SCORES, full_mask(8, 1), UIDS)
    a_pos = 0.5 / (1 / SQRT3 + 1e-6)
    b_neg = -0.75 / (0.5 + 1e-6)
    torch.testing.assert_close(adv[0, 0], torch.tensor(a_pos))
    torch.testing.assert_close(adv[7, 0], torch.tensor(b_neg))


def test_grpo_large_epsilon() -> None:
    adv, _ = grpo_advantages(SCORES, full_mask(8, 1), UIDS, epsilon=0.5)
    # b: 0.25 / (0.5 + 0.5) = 0.25 and -0.75 / 1.0 = -0.75
    torch.testing.assert_close(adv[[1, 3, 5, 7], 0], torch.tensor([0.25, 0.25, 0.25, -0.75]))
    # a: 0.5 / (1/sqrt(3) + 0.5)
    torch.testing.assert_close(adv[0, 0], torch.tensor(0.5 / (1 / SQRT3 + 0.5)))


def test_dr_grpo_no_std_normalisation() -> None:
    adv, _ = grpo_advantages(SCORES, full_mask(8, 2), UIDS, norm_by_std=False)
    expected = torch.tensor([0.5, 0.25, -0.5, 0.25, -0.5, 0.25, 0.5, -0.75])
    torch.testing.assert_close(adv, expected.unsqueeze(-1).expand(8, 2))
    # "reinforce" is the same group-mean baseline
    reinforce, _ = ADVANTAGES.get("reinforce")(SCORES, full_mask(8, 2), UIDS)
    torch.testing.assert_close(reinforce, adv)


def test_grpo_single_sample_group_keeps_raw_score() -> None:
    scores = torch.tensor([3.0, 1.0, 0.0])
    uids = ["solo", "pair", "pair"]
    adv, _ = grpo_advantages(scores, full_mask(3, 1), uids, epsilon=0.0)
    # solo: mean 0, std 1 -> 3.0; pair: mean 0.5, std sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-sqrt(0.5)
    torch.testing.assert_close(adv[:, 0], torch.tensor([3.0, math.sqrt(0.5), -math.sqrt(0.5)]))
    adv, _ = grpo_advantages(scores, full_mask(3, 1), uids)  # default epsilon 1e-6
    torch.testing.assert_close(adv[0, 0], torch.tensor(3.0 / (1.0 + 1e-6)))
    adv, _ = grpo_advantages(scores, full_mask(3, 1), uids, norm_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([3.0, 0.5, -0.5]))


def test_grpo_constant_group_gives_zero_not_nan() -> None:
    adv, _ = grpo_advantages(torch.tensor([2.0, 2.0, 2.0]), full_mask(3, 2), ["g"] * 3)
    torch.testing.assert_close(adv, torch.zeros(3, 2))


def test_grpo_masks_padding() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])  # group "a" of four, as above
    adv, returns = grpo_advantages(scores, mask, ["a"] * 4, epsilon=0.0)
    h = SQRT3 / 2
    expected = torch.tensor([[h, h, 0, 0], [-h, -h, -h, -h], [-h, 0, 0, 0], [h, h, h, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_rloo_leave_one_out() -> None:
    mask = full_mask(8, 2)
    mask[1, 1] = 0  # one padded token
    adv, returns = rloo_advantages(SCORES, mask, UIDS)
    # a: a 1 minus the mean of {1, 0, 0} = 2/3; a 0 minus the mean of {1, 0, 1} = -2/3
    # b: a 1 minus the mean of {1, 1, 0} = 1/3; the 0 minus the mean of {1, 1, 1} = -1
    per_row = torch.tensor([2 / 3, 1 / 3, -2 / 3, 1 / 3, -2 / 3, 1 / 3, 2 / 3, -1.0])
    expected = per_row.unsqueeze(-1).expand(8, 2).clone()
    expected[1, 1] = 0.0
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_rloo_single_sample_group_keeps_raw_score() -> None:
    adv, _ = rloo_advantages(torch.tensor([5.0, 2.0, 4.0]), full_mask(3, 1), ["solo", "p", "p"])
    # solo: 5; pair: 2 - 4 = -2, 4 - 2 = 2
    torch.testing.assert_close(adv[:, 0], torch.tensor([5.0, -2.0, 2.0]))


# GAE on one row of three tokens, gamma = 0.9, lam = 0.8 (so gamma * lam = 0.72).
REWARDS = torch.tensor([[0.1, 0.2, 1.0]])
VALUES = torch.tensor([[0.5, 0.4, 0.3]])


def test_gae_full_row_by_hand() -> None:
    adv, returns = gae_advantages(REWARDS, VALUES, torch.ones(1, 3), gamma=0.9, lam=0.8, whiten=False)
    # t=2: delta = 1.0 + 0.9*0 - 0.3 = 0.7;                 A2 = 0.7
    # t=1: delta = 0.2 + 0.9*0.3 - 0.4 = 0.07;              A1 = 0.07 + 0.72*0.7 = 0.574
    # t=0: delta = 0.1 + 0.9*0.4 - 0.5 = -0.04;             A0 = -0.04 + 0.72*0.574 = 0.37328
    torch.testing.assert_close(adv, torch.tensor([[0.37328, 0.574, 0.7]]))
    torch.testing.assert_close(returns, torch.tensor([[0.87328, 0.974, 1.0]]))


def test_gae_skips_a_padded_position() -> None:
    rewards = REWARDS.clone()
    values = VALUES.clone()
    rewards[0, 1], values[0, 1] = 7.0, -9.0  # garbage at the padded position: must not matter
    adv, returns = gae_advantages(rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.9, lam=0.8,
                                  whiten=False)
    # t=2: A2 = 0.7, next value 0.3;  t=1 skipped
    # t=0: delta = 0.1 + 0.9*0.3 - 0.5 = -0.13;  A0 = -0.13 + 0.72*0.7 = 0.374
    torch.testing.assert_close(adv, torch.tensor([[0.374, 0.0, 0.7]]))
    torch.testing.assert_close(returns, torch.tensor([[0.874, 0.0, 1.0]]))


def test_gae_trailing_padding() -> None:
    rewards = REWARDS.clone()
    values = VALUES.clone()
    rewards[0, 2], values[0, 2] = 5.0, 9.0
    adv, returns = gae_advantages(rewards, values, torch.tensor([[1.0, 1.0, 0.0]]), gamma=0.9, lam=0.8,
                                  whiten=False)
    # t=1: delta = 0.2 + 0 - 0.4 = -0.2;  A1 = -0.2
    # t=0: delta = 0.1 + 0.9*0.4 - 0.5 = -0.04;  A0 = -0.04 + 0.72*(-0.2) = -0.184
    torch.testing.assert_close(adv, torch.tensor([[-0.184, -0.2, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.316, 0.2, 0.0]]))


def test_gae_gamma_one_lam_one_is_reward_to_go_minus_value() -> None:
    adv, _ = gae_advantages(REWARDS, VALUES, torch.ones(1, 3), whiten=False)
    # reward-to-go: 1.3, 1.2, 1.0; minus values 0.5, 0.4, 0.3
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.8, 0.7]]))


def test_gae_whiten_over_masked_tokens() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.cat([REWARDS, torch.tensor([[0.0, 1.0, 3.0]])])
    values = torch.cat([VALUES, torch.tensor([[0.2, 0.1, 4.0]])])
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True)
    kept = adv[mask.bool()]
    torch.testing.assert_close(kept.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(kept.std(), torch.tensor(1.0), atol=1e-4, rtol=0)
    assert adv[1, 2] == 0.0 and returns[1, 2] == 0.0
    # returns are not whitened: row 0 as in the full-row test
    torch.testing.assert_close(returns[0], torch.tensor([0.87328, 0.974, 1.0]))


def test_unknown_estimator_lists_names() -> None:
    with pytest.raises(ValueError, match="dr_grpo, gae, grpo, opo, reinforce, reinforce_plus_plus, "
                                         "reinforce_plus_plus_baseline, remax, rloo"):
        ADVANTAGES.get("ppo")


def test_gae_keeps_float64_inputs() -> None:
    adv, returns = gae_advantages(REWARDS.double(), VALUES.double(), torch.ones(1, 3), gamma=0.9, lam=0.8,
                                  whiten=False)
    assert adv.dtype == returns.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor([[0.37328, 0.574, 0.7]], dtype=torch.float64))


def test_estimators_stay_on_the_input_device() -> None:
    """No tensor is created on the default (CPU) device: "meta" stands in for an accelerator."""
    meta = torch.device("meta")
    adv, returns = gae_advantages(REWARDS.to(meta), VALUES.to(meta), torch.ones(1, 3, device=meta))
    assert adv.device == returns.device == meta
    for fn in (grpo_advantages, rloo_advantages):
        adv, _ = fn(SCORES.to(meta), full_mask(8).to(meta), UIDS)
        assert adv.device == meta and adv.shape == (8, 3)


def test_group_signal_metrics_count_groups_without_signal_and_distinct_responses() -> None:
    from rltrainer.algorithms.advantages import group_signal_metrics

    # groups: "a" all right (no signal), "b" all wrong (no signal), "c" mixed
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    uids = ["a", "b", "a", "b", "c", "c"]
    # responses (masked): a: [1, 2] twice -> 1 distinct of 2; b: [3] and [4] -> 2; c: [1] and [1, 1] -> 2
    responses = torch.tensor([[1, 2], [3, 9], [1, 2], [4, 9], [1, 9], [1, 1]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 0], [1, 1]])
    metrics = group_signal_metrics(scores, uids, responses, mask)
    assert metrics["critic/groups/zero_std_ratio"] == pytest.approx(2 / 3)
    assert metrics["critic/groups/solve_all_ratio"] == pytest.approx(1 / 3)
    assert metrics["critic/groups/solve_none_ratio"] == pytest.approx(1 / 3)
    assert metrics["response/distinct_ratio"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    # the zero-std groups are exactly the groups whose GRPO advantages are all 0
    adv, _ = grpo_advantages(scores, torch.ones(6, 1), uids)
    zero_groups = {u for u in uids if all(adv[i].abs().sum() == 0 for i, v in enumerate(uids) if v == u)}
    assert len(zero_groups) / 3 == pytest.approx(metrics["critic/groups/zero_std_ratio"])
    assert "response/distinct_ratio" not in group_signal_metrics(scores, uids)
