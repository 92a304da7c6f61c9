"""Every policy loss against verl's formula, written out here (nothing vendored), on one batch:
value, gradient with respect to ``log_probs`` and metrics, to 1e-6 (float64).

References (verl ``verl/trainer/ppo/core_algos.py`` at b178a3c unless said otherwise; read with
``git show b178a3c:verl/trainer/ppo/core_algos.py``):

- ``ppo_clip``: ``compute_policy_loss_vanilla`` (lines 1160-1250)
- ``gspo``: ``compute_policy_loss_gspo`` (1254-1326)
- ``sapo``: ``compute_policy_loss_sapo`` (1330-1411)
- ``clip_cov``: ``compute_policy_loss_clip_cov`` (1451-1552)
- ``kl_cov``: ``compute_policy_loss_kl_cov`` (1556-1632)
- ``cispo``: ``compute_policy_loss_cispo`` (1722-1779)
- ``dppo_tv`` / ``dppo_kl``: ``compute_policy_loss_dppo_tv`` / ``_dppo_kl``, added to verl after
  b178a3c (``register_policy_loss("dppo_tv")``), arXiv:2602.04879
- aggregation: ``agg_loss`` (1025-1081)

TRL's versions of GSPO, CISPO, SAPO and DAPO are checked against TRL itself in
``test_trl_parity.py``.
"""

from __future__ import annotations

import pytest
import torch

from rltrainer.algorithms import POLICY_LOSSES, LossContext
from rltrainer.algorithms.losses import token_covariance

N, T = 6, 5
TOL = dict(rtol=0, atol=1e-6)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # verl_F.masked_mean
    return (x * mask).sum() / (mask.sum() + 1e-8)


def verl_agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's agg_loss (core_algos.py:1025-1081) with dp_size 1 and the local counts."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_tokens = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
    else:
        seq_losses = (loss_mat * mask).sum(-1)
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


@pytest.fixture()
def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [N, T]
    log_probs = -3.0 * torch.rand(N, T, generator=gen, dtype=torch.float64)  # probabilities 0.05 .. 1
    old = (log_probs + 0.8 * (torch.rand(N, T, generator=gen, dtype=torch.float64) - 0.5)).clamp(max=-1e-3)
    adv = torch.tensor([1.5, -1.0, 0.7, -2.0, 0.3, -0.4], dtype=torch.float64).unsqueeze(-1).expand(N, T) * mask
    return {"log_probs": log_probs, "old_log_probs": old, "advantages": adv.contiguous(), "response_mask": mask}


def ours(name: str, batch: dict[str, torch.Tensor], mode: str = "token-mean", extras: dict | None = None,
         **params: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    log_probs = batch["log_probs"].clone().requires_grad_(True)
    loss, metrics = POLICY_LOSSES.build(name, log_probs=log_probs, old_log_probs=batch["old_log_probs"],
                                        advantages=batch["advantages"], response_mask=batch["response_mask"],
                                        ctx=LossContext(mode, extras=extras or {}), **params)
    loss.backward()
    return loss.detach(), log_probs.grad, metrics


def reference(fn, batch: dict[str, torch.Tensor], mode: str, **params: object
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    log_probs = batch["log_probs"].clone().requires_grad_(True)
    loss_mat, metrics, mode = fn(log_probs, batch["old_log_probs"], batch["advantages"], batch["response_mask"],
                                 mode, **params)
    loss = verl_agg_loss(loss_mat, batch["response_mask"], mode)
    loss.backward()
    return loss.detach(), log_probs.grad, metrics


def check(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    for key, value in want[2].items():
        torch.testing.assert_close(got[2][key], value.to(got[2][key].dtype), **TOL, msg=key)
    assert got[1].abs().sum() > 0


# -- verl's formulas ------------------------------------------------------------------------------
def verl_vanilla(log_prob, old_log_prob, advantages, mask, mode, low, high, clip_ratio_c):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    metrics = {"actor/pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).double(), mask),
               "actor/pg_clipfrac_lower": masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).double(),
                                                      mask),
               "actor/ppo_kl": masked_mean(-negative_approx_kl, mask)}
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), metrics, mode


def verl_gspo(log_prob, old_log_prob, advantages, mask, mode, low, high):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
    metrics = {"actor/pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).double(), mask),
               "actor/ppo_kl": masked_mean(-negative_approx_kl, mask)}
    return torch.maximum(pg_losses1, pg_losses2), metrics, "seq-mean-token-mean"  # verl forces this mode


def verl_sapo(log_prob, old_log_prob, advantages, mask, mode, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype),
                       torch.as_tensor(tau_neg, dtype=advantages.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return -gates * advantages, {}, "seq-mean-token-mean"  # verl forces this mode


def verl_cispo(log_prob, old_log_prob, advantages, mask, mode, low, high):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    metrics = {"actor/pg_clipfrac": masked_mean((ratio != clipped_ratio).double(), mask),
               "actor/ppo_kl": masked_mean(-negative_approx_kl, mask)}
    return -clipped_ratio.detach() * advantages * log_prob, metrics, mode


def verl_dppo(log_prob, old_log_prob, advantages, mask, mode, low, high, clip_ratio_c, divergence):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        valid_positive_mask = (prob - old_prob) <= high
        valid_negative_mask = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().double()
    metrics = {"actor/pg_clipfrac": masked_mean(1.0 - valid_mask, mask),
               "actor/pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).double() * valid_mask, mask),
               "actor/ppo_kl": masked_mean(-negative_approx_kl, mask)}
    return -advantages * truncated_ratio * log_prob * valid_mask, metrics, mode


def verl_clip_cov(log_prob, old_log_prob, advantages, mask, mode, low, high, ratio_, lb, ub):
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)
    cov_all = (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob.detach(), mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_ * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    assert len(top_k_idx) <= clip_num  # every candidate is taken, so verl's random choice is no choice
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    metrics = {"actor/pg_clipfrac": masked_mean((corr == 0).double(), mask)}
    return torch.maximum(pg_losses1, pg_losses2) * corr, metrics, mode


def verl_kl_cov(log_prob, old_log_prob, advantages, mask, mode, kl_cov_ratio, ppo_kl_coef):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses = (-advantages * ratio).clone()
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * negative_approx_kl.abs()
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1)
    all_valid_logp = log_prob[all_valid].detach().reshape(-1)
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
    rows, cols = large // advantages.shape[1], large % advantages.shape[1]
    pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return pg_losses, {"actor/ppo_kl": masked_mean(negative_approx_kl.abs(), mask)}, mode


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("low, high, c", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5)])
def test_ppo_clip_matches_verl_vanilla(batch, mode, low, high, c) -> None:
    got = ours("ppo_clip", batch, mode, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    check(got, reference(verl_vanilla, batch, mode, low=low, high=high, clip_ratio_c=c))
    assert got[2]["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("low, high", [(3e-4, 4e-4), (0.05, 0.05)])
def test_gspo_matches_verl(batch, low, high) -> None:
    got = ours("gspo", batch, "seq-mean-token-mean", clip_ratio_low=low, clip_ratio_high=high)
    check(got, reference(verl_gspo, batch, "seq-mean-token-mean", low=low, high=high))
    assert 0 < got[2]["actor/pg_clipfrac"] < 1  # some sequences clipped, some not


def test_sapo_matches_verl(batch) -> None:
    got = ours("sapo", batch, "seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05)
    check(got, reference(verl_sapo, batch, "seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05))
    got = ours("sapo", batch, "seq-mean-token-mean", tau_pos=4.0, tau_neg=8.0)
    check(got, reference(verl_sapo, batch, "seq-mean-token-mean", tau_pos=4.0, tau_neg=8.0))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_matches_verl(batch, mode) -> None:
    got = ours("cispo", batch, mode, clip_ratio_low=0.2, clip_ratio_high=0.2)
    check(got, reference(verl_cispo, batch, mode, low=0.2, high=0.2))
    assert got[2]["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_matches_verl(batch, name) -> None:
    params = dict(clip_ratio_low=0.1, clip_ratio_high=0.05, clip_ratio_c=1.3)
    got = ours(name, batch, "token-mean", **params)
    want = reference(verl_dppo, batch, "token-mean", low=0.1, high=0.05, clip_ratio_c=1.3, divergence=name[-2:])
    check(got, want)
    assert 0 < got[2]["actor/pg_clipfrac"] < 1 and got[2]["actor/pg_clipfrac_lower"] > 0


def on_policy(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh rollouts at the first step: log-probs equal the old ones (verl selects from the current
    log-probs, rltrainer once per batch from the old; the two agree here)."""
    return {**batch, "old_log_probs": batch["log_probs"].clone()}


def test_clip_cov_matches_verl(batch) -> None:
    batch = on_policy(batch)
    params = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=0.6)
    extras = POLICY_LOSSES.get("clip_cov").prepare(batch["old_log_probs"], batch["advantages"],
                                                   batch["response_mask"], **params)
    got = ours("clip_cov", batch, "token-mean", extras, **params)
    check(got, reference(verl_clip_cov, batch, "token-mean", low=0.2, high=0.2, ratio_=1.0, lb=0.05, ub=0.6))
    assert 0 < got[2]["actor/pg_clipfrac"] < 1  # some tokens cut off, not all
    cov = token_covariance(batch["old_log_probs"], batch["advantages"], batch["response_mask"])
    masked = batch["response_mask"] > 0
    assert (cov[masked] > 0.6).any() and (cov[masked] < 0.05).any()  # both bounds exclude some tokens


@pytest.mark.parametrize("kl_cov_ratio", [0.2, 2e-4])
def test_kl_cov_matches_verl(batch, kl_cov_ratio) -> None:
    batch = on_policy(batch)
    params = dict(kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=0.5)
    extras = POLICY_LOSSES.get("kl_cov").prepare(batch["old_log_probs"], batch["advantages"],
                                                 batch["response_mask"], **params)
    assert extras["cov_selected"].sum() == max(1, int(kl_cov_ratio * batch["response_mask"].sum()))
    # the KL term's gradient at log r = 0 is the subgradient of |x| (0 in torch): move the current
    # log-probs off the old ones after the selection (both signs), as the update does on its later
    # steps, by little enough that verl's selection from them is the same tokens (asserted below)
    signs = torch.where(torch.arange(N * T).reshape(N, T) % 2 == 0, 1.0, -1.0).double()
    moved = {**batch, "log_probs": batch["log_probs"] + 1e-3 * signs}
    got = ours("kl_cov", moved, "token-mean", extras, **params)
    want_batch = moved | {"old_log_probs": batch["old_log_probs"]}
    log_probs = want_batch["log_probs"].clone().requires_grad_(True)
    verl_selected = POLICY_LOSSES.get("kl_cov").prepare(moved["log_probs"], batch["advantages"],
                                                        batch["response_mask"], **params)["cov_selected"]
    torch.testing.assert_close(verl_selected, extras["cov_selected"], rtol=0, atol=0)
    loss_mat, metrics, _ = verl_kl_cov(log_probs, want_batch["old_log_probs"], want_batch["advantages"],
                                       want_batch["response_mask"], "token-mean", kl_cov_ratio, 0.5)
    loss = verl_agg_loss(loss_mat, want_batch["response_mask"], "token-mean")
    loss.backward()
    check(got, (loss.detach(), log_probs.grad, metrics))


def test_every_loss_has_a_parity_test() -> None:
    covered = {"ppo_clip", "gspo", "sapo", "cispo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"}
    assert set(POLICY_LOSSES.names()) - covered <= set(), "a new policy loss needs a parity test here"
