"""Every advantage estimator against its reference's formula, written out here (nothing vendored):
verl's ``verl/trainer/ppo/core_algos.py`` at b178a3c (loops over ``id2score`` as verl writes them),
TRL 1.16's RLOO; advantages and returns to 1e-6 (float64).

- ``grpo`` / ``dr_grpo``: ``compute_grpo_outcome_advantage`` (core_algos.py:267-330)
- ``rloo``: ``compute_rloo_outcome_advantage`` (477-525); TRL ``RLOOTrainer`` (rloo_trainer.py:1682-1690)
- ``opo``: ``compute_opo_outcome_advantage`` (529-579)
- ``reinforce_plus_plus``: ``compute_reinforce_plus_plus_outcome_advantage`` (583-618)
- ``reinforce_plus_plus_baseline``: ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (425-473)
- ``remax``: ``compute_remax_outcome_advantage`` (622-654)
- ``gae``: ``compute_gae_advantage_return`` (215-263)
- whitening: ``masked_whiten`` (verl/utils/torch_functional.py:304-339); KL in the token rewards:
  ``apply_kl_penalty`` (verl/trainer/ppo/ray_trainer.py:70-98, ``kl_penalty="kl"``: k1)
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from rltrainer.algorithms import ADVANTAGES, AdvantageContext

N, T = 9, 5
TOL = dict(rtol=0, atol=1e-6)
UIDS = ["a", "b", "a", "c", "b", "a", "b", "a", "b"]  # groups of 4, 4 and 1 (a single sample), interleaved


@pytest.fixture()
def data() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5, 5, 2, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [N, T]
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 0.0, 0.25, 1.0, 0.0], dtype=torch.float64)
    # log-probs and values carry garbage on padding: it must not count
    old = -2.0 * torch.rand(N, T, generator=gen, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(N, T, generator=gen, dtype=torch.float64)
    values = torch.randn(N, T, generator=gen, dtype=torch.float64)
    group_baseline = {"a": 0.5, "b": 1.0, "c": 0.0}  # the score of each prompt's greedy response (ReMax)
    baselines = torch.tensor([group_baseline[u] for u in UIDS], dtype=torch.float64)
    return {"scores": scores, "mask": mask, "old": old, "ref": ref, "values": values, "baselines": baselines}


def ours(name: str, data: dict, **params: object) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = AdvantageContext(values=data["values"], old_log_probs=data["old"], ref_log_probs=data["ref"],
                           reward_baselines=data["baselines"])
    return ADVANTAGES.build(name, scores=data["scores"], response_mask=data["mask"], uids=UIDS, ctx=ctx, **params)


# -- the references -------------------------------------------------------------------------------
def token_level_rewards(data: dict, kl_coef: float = 0.0) -> torch.Tensor:
    """The score at each row's last token (verl's reward manager), minus ``kl_coef * k1`` (apply_kl_penalty)."""
    mask = data["mask"]
    rewards = torch.zeros_like(mask)
    for i in range(N):
        rewards[i, int(torch.nonzero(mask[i])[-1])] = data["scores"][i]  # the last response token
    kld = (data["old"] - data["ref"]) * mask
    return rewards - kl_coef * kld


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    variance = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    variance = variance * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def group_scores(scores: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    id2score = defaultdict(list)
    for i in range(N):
        id2score[UIDS[i]].append(scores[i])
    return id2score


def verl_grpo(data: dict, epsilon: float, norm: bool) -> torch.Tensor:
    scores = token_level_rewards(data).sum(-1)
    id2score, id2mean, id2std = group_scores(scores), {}, {}
    for idx, values in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(values) == 1 else torch.mean(torch.stack(values))
        id2std[idx] = torch.tensor(1.0) if len(values) == 1 else torch.std(torch.stack(values))
    out = torch.stack([(scores[i] - id2mean[UIDS[i]]) / (id2std[UIDS[i]] + epsilon) if norm
                       else scores[i] - id2mean[UIDS[i]] for i in range(N)])
    return out.unsqueeze(-1) * data["mask"]


def verl_rloo(data: dict) -> torch.Tensor:
    scores = token_level_rewards(data).sum(-1)
    id2score = group_scores(scores)
    out = scores.clone()
    for i in range(N):
        n = len(id2score[UIDS[i]])
        if n > 1:
            mean = torch.mean(torch.stack(id2score[UIDS[i]]))
            out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out.unsqueeze(-1) * data["mask"]


def trl_rloo(data: dict) -> torch.Tensor:
    """TRL's leave-one-out baseline ``(group sum - reward) / (count - 1)`` (rloo_trainer.py:1686-1690),
    for groups of more than one sample (TRL's groups are contiguous and of equal size)."""
    out = data["scores"].clone()
    for g in ("a", "b"):
        rows = [i for i in range(N) if UIDS[i] == g]
        rewards = data["scores"][rows]
        baselines = (rewards.sum() - rewards) / (len(rows) - 1)
        out[rows] = rewards - baselines
    return out


def verl_opo(data: dict) -> torch.Tensor:
    scores, lengths = token_level_rewards(data).sum(-1), data["mask"].sum(-1)
    id2score, id2len, id2bsl = defaultdict(list), defaultdict(list), {}
    for i in range(N):
        id2score[UIDS[i]].append(scores[i])
        id2len[UIDS[i]].append(lengths[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2bsl[idx] = torch.tensor(0.0)
        else:
            s, n = torch.stack(id2score[idx]), torch.stack(id2len[idx])
            id2bsl[idx] = (n * s).sum() / n.sum()
    return torch.stack([scores[i] - id2bsl[UIDS[i]] for i in range(N)]).unsqueeze(-1) * data["mask"]


def verl_reinforce_pp(data: dict, gamma: float, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, mask = token_level_rewards(data, kl_coef), data["mask"]
    returns = torch.zeros_like(rewards)
    running_return = 0
    for t in reversed(range(T)):
        running_return = rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask, returns


def verl_reinforce_pp_baseline(data: dict, kl_coef: float) -> torch.Tensor:
    mask = data["mask"]
    scores = token_level_rewards(data, kl_coef).sum(-1)
    id2score = group_scores(scores)
    id2mean = {k: torch.tensor(0.0) if len(v) == 1 else torch.mean(torch.stack(v)) for k, v in id2score.items()}
    centred = torch.stack([scores[i] - id2mean[UIDS[i]] for i in range(N)])
    tiled = centred.unsqueeze(-1).tile([1, T]) * mask
    return verl_masked_whiten(tiled, mask) * mask


def verl_remax(data: dict, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, mask = token_level_rewards(data, kl_coef), data["mask"]
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - data["baselines"].unsqueeze(-1) * mask, returns


def verl_gae(data: dict, gamma: float, lam: float, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    rewards, values, mask = token_level_rewards(data, kl_coef), data["values"], data["mask"]
    nextvalues, lastgaelam, reversed_adv = 0, 0, []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, mask), returns


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("epsilon", [1e-6, 0.1])
def test_grpo_and_dr_grpo_match_verl(data, epsilon) -> None:
    adv, ret = ours("grpo", data, epsilon=epsilon)
    torch.testing.assert_close(adv, verl_grpo(data, epsilon, norm=True), **TOL)
    torch.testing.assert_close(ret, adv, **TOL)
    adv, _ = ours("dr_grpo", data)
    torch.testing.assert_close(adv, verl_grpo(data, 1e-6, norm=False), **TOL)


def test_rloo_matches_verl_and_trl(data) -> None:
    adv, _ = ours("rloo", data)
    torch.testing.assert_close(adv, verl_rloo(data), **TOL)
    grouped = [i for i in range(N) if UIDS[i] != "c"]  # TRL has no group of one
    torch.testing.assert_close(adv[grouped, 0], trl_rloo(data)[grouped], **TOL)


def test_opo_matches_verl(data) -> None:
    adv, _ = ours("opo", data)
    torch.testing.assert_close(adv, verl_opo(data), **TOL)
    assert not torch.allclose(adv, ours("reinforce", data)[0])  # length weighting matters here


@pytest.mark.parametrize("gamma, kl_coef", [(1.0, 0.0), (0.9, 0.1)])
def test_reinforce_plus_plus_matches_verl(data, gamma, kl_coef) -> None:
    adv, ret = ours("reinforce_plus_plus", data, gamma=gamma, kl_in_reward_coef=kl_coef)
    want_adv, want_ret = verl_reinforce_pp(data, gamma, kl_coef)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


def test_reinforce_plus_plus_resets_the_return_at_a_masked_token(data) -> None:
    """A token rejected inside a response (a rollout correction) cuts the return-to-go there, as in verl."""
    data["mask"] = data["mask"].clone()
    data["mask"][0, 2] = 0.0  # row 0 keeps tokens 0, 1, 3, 4; its reward sits on token 4
    adv, ret = ours("reinforce_plus_plus", data, gamma=0.9, kl_in_reward_coef=0.1)
    want_adv, want_ret = verl_reinforce_pp(data, 0.9, 0.1)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_reinforce_plus_plus_baseline_matches_verl(data, kl_coef) -> None:
    adv, ret = ours("reinforce_plus_plus_baseline", data, kl_in_reward_coef=kl_coef)
    torch.testing.assert_close(adv, verl_reinforce_pp_baseline(data, kl_coef), **TOL)
    torch.testing.assert_close(ret, adv, **TOL)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_remax_matches_verl(data, kl_coef) -> None:
    adv, ret = ours("remax", data, kl_in_reward_coef=kl_coef)
    want_adv, want_ret = verl_remax(data, kl_coef)
    torch.testing.assert_close(adv, want_adv, **TOL)
    torch.testing.assert_close(ret, want_ret, **TOL)


@pytest.mark.parametrize("gamma, lam, kl_coef", [(1.0, 0.95, 0.0), (0.9, 0.8, 0.05)])
def test_gae_matches_verl(data, gamma, lam, kl_coef) -> None:
    adv, ret = ours("gae", data, gamma=gamma, lam=lam, kl_in_reward_coef=kl_coef)
    want_adv, want_ret = verl_gae(data, gamma, lam, kl_coef)
    mask = data["mask"]
    torch.testing.assert_close(adv, want_adv * mask, **TOL)  # verl leaves whitened values on padding
    torch.testing.assert_close(ret, want_ret * mask, **TOL)  # and values there; rltrainer zeroes both


def test_kl_in_reward_needs_the_log_probs(data) -> None:
    with pytest.raises(KeyError, match="needs 'old_log_probs'"):
        ADVANTAGES.build("reinforce_plus_plus", scores=data["scores"], response_mask=data["mask"], uids=UIDS,
                         kl_in_reward_coef=0.1)


def test_every_estimator_has_a_parity_test() -> None:
    covered = {"grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax",
               "reinforce"}  # reinforce is dr_grpo (tests/algorithms/test_advantages.py)
    assert set(ADVANTAGES.names()) <= covered, "a new estimator needs a parity test here"
