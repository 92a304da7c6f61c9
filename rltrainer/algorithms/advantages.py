"""Advantage estimators (registry entries), looked up by name and called with one signature::

    fn(scores [N], response_mask [N, T], uids [N], ctx: AdvantageContext | None = None, **params)
        -> (advantages [N, T], returns [N, T])    # zero on padding

``scores`` are the sequence rewards, ``uids`` each row's group (prompt). ``ctx`` carries what some
estimators need besides: the critic's ``values`` (GAE), the old and reference log-probs (a KL
penalty folded into the token rewards, ``kl_in_reward_coef``). An entry that needs one of those
says so with :func:`requires` (``fn.requires(params) -> set of field names``), so a module can
refuse it at construction (GRPO has no critic) and schedule the passes that provide it.
``params`` are the entry's own parameters, registered with it as defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rltrainer.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rltrainer.registry import Registry
from rltrainer.values import check_float

ADVANTAGES: Registry = Registry("advantage estimator")


@dataclass(frozen=True)
class AdvantageContext:
    """What some estimators need besides scores, mask and groups (all on the controller)."""

    values: torch.Tensor | None = None  # [N, T] the critic's values (GAE)
    old_log_probs: torch.Tensor | None = None  # [N, T] the policy's, before the update
    ref_log_probs: torch.Tensor | None = None  # [N, T] the reference model's
    reward_baselines: torch.Tensor | None = None  # [N] the score of a greedy response to each row's prompt (ReMax)
    token_level_scores: torch.Tensor | None = None  # [N, T] per-token rewards whose rows sum to the scores

    def get(self, name: str, estimator: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise KeyError(f"Advantage estimator {estimator!r} needs {name!r}; the batch has none")
        return value


def requires(fields: Callable[[dict], set[str]]) -> Callable[[Callable], Callable]:
    """Declare which :class:`AdvantageContext` fields an entry needs, given its parameters."""

    def decorator(fn: Callable) -> Callable:
        fn.requires = fields  # type: ignore[attr-defined]
        return fn

    return decorator


def uses_groups(fn: Callable) -> Callable:
    """Mark an entry whose baseline (or scale) comes from the other samples of each prompt's group:
    with one sample per prompt it has no signal, so a module refuses ``G = 1`` with it
    (:func:`group_estimators`)."""
    fn.uses_groups = True  # type: ignore[attr-defined]
    return fn


def group_estimators() -> list[str]:
    """The registered estimators that need groups of two or more samples."""
    return [name for name in ADVANTAGES.names() if getattr(ADVANTAGES.get(name), "uses_groups", False)]


def check_group_size(estimator: str, num_generations: int) -> None:
    """Refuse one sample per prompt with an estimator whose baseline is the group's (its advantages
    would be the raw score, or 0, with no group to compare to: a run that cannot learn)."""
    if num_generations == 1 and getattr(ADVANTAGES.get(estimator), "uses_groups", False):
        others = [n for n in ADVANTAGES.names() if n not in group_estimators() and n != "gae"]
        raise ValueError(
            f"num_generations=1 with advantage_estimator={estimator!r}: its baseline comes from the other samples "
            f"of each prompt's group ({', '.join(group_estimators())} all do), and a group of one has none, so "
            f"every group has zero reward spread and no learning signal. Use num_generations >= 2 (GRPO papers "
            f"use 4-16), or an estimator without groups: {', '.join(others)} (or rltrainer.PPO's 'gae').")


def _kl_fields(params: dict) -> set[str]:
    return {"old_log_probs", "ref_log_probs"} if params.get("kl_in_reward_coef", 0.0) else set()


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor, ctx: AdvantageContext | None,
                          kl_in_reward_coef: float, kl_estimator: str, name: str) -> torch.Tensor:
    """Token rewards ``[N, T]``: the score on each row's last (unmasked) response token (or the
    per-token rewards ``ctx.token_level_scores`` when a reward function returned lists, with what the
    scores gained since, e.g. a penalty or a reward model's score, on the last token), minus
    ``kl_in_reward_coef * KL(pi_old || pi_ref)`` per token (verl's ``apply_kl_penalty``,
    ray_trainer.py:70-98 at b178a3c: ``token_level_scores - beta * kld``).

    The last token is that of ``response_mask`` as given, after any rollout correction: if the
    correction rejected a response's last token the score moves to the last kept one (verl places
    it before the rejection, where the estimator then skips it and the reward is lost)."""
    KL_ESTIMATORS.get(kl_estimator)  # an unknown name raises, listing the names
    dtype = torch.promote_types(scores.dtype, torch.float32)
    mask = response_mask.to(dtype)
    rewards = torch.zeros(mask.shape, dtype=dtype, device=scores.device)
    outcome = scores.to(dtype)  # [N] what goes on the last token
    if ctx is not None and ctx.token_level_scores is not None:  # per-token rewards (a reward returned lists)
        rewards = ctx.token_level_scores.to(dtype) * mask
        outcome = outcome - rewards.sum(-1)  # what was added to the scores since (a penalty, a reward model)
    positions = torch.arange(mask.shape[1], device=mask.device, dtype=mask.dtype)
    last = (mask * (positions + 1)).argmax(-1)  # [N] each row's last response token (0 if none)
    rewards[torch.arange(len(scores), device=scores.device), last] += outcome
    if kl_in_reward_coef:
        ctx = ctx or AdvantageContext()
        old, ref = ctx.get("old_log_probs", name).to(dtype), ctx.get("ref_log_probs", name).to(dtype)
        kl = kl_penalty(old, ref, kl_estimator)  # [N, T]
        rewards = rewards - kl_in_reward_coef * kl * mask
    return rewards * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) * rsqrt(unbiased var + 1e-8)`` over the masked entries (verl's ``masked_whiten``,
    verl/utils/torch_functional.py:322 at b178a3c)."""
    n = mask.sum()
    if n < 2:
        raise ValueError(f"Whitening needs at least 2 response tokens in the batch, got {int(n)}")
    mean = (values * mask).sum() / (n + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (n + 1e-8) * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def group_index(uids: Sequence[object]) -> torch.Tensor:
    """Map group ids (any hashable) to consecutive integers ``[N]``."""
    _, inverse = np.unique(np.asarray([str(u) for u in uids]), return_inverse=True)
    return torch.from_numpy(inverse.astype(np.int64))


def _group_stats(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased group std and group size."""
    n_groups = int(groups.max()) + 1 if len(groups) else 0
    groups = groups.to(scores.device)
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.clone().index_add_(0, groups, torch.ones_like(scores))
    total = zeros.clone().index_add_(0, groups, scores)
    mean = total / count
    sq = zeros.clone().index_add_(0, groups, (scores - mean[groups]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[groups], std[groups], count[groups]


def group_signal_metrics(scores: torch.Tensor, uids: Sequence[object], responses: torch.Tensor | None = None,
                         response_mask: torch.Tensor | None = None) -> dict[str, float]:
    """How much learning signal a batch of groups carries, for group-baseline estimators.

    - ``critic/groups/zero_std_ratio``: share of groups whose scores are all equal (TRL's
      ``frac_reward_zero_std``). Their advantages are exactly 0, so they add nothing to the update.
    - ``critic/groups/solve_none_ratio`` / ``solve_all_ratio``: groups where every score is <= 0 /
      >= 1 (for a 0/1 verifiable reward: no sample right / every sample right).
    - ``response/distinct_ratio``: distinct responses per group over the group size (1: every
      sample differs; ``1/G``: the policy samples one answer), from ``responses [N, T]`` masked
      by ``response_mask``.

    ``scores [N]``; ``uids`` gives each row's group.
    """
    groups = group_index(uids)
    n_groups = int(groups.max()) + 1 if len(groups) else 0
    if n_groups == 0:
        return {}
    scores = scores.float().cpu()
    lo = torch.full((n_groups,), math.inf).scatter_reduce(0, groups, scores, "amin")
    hi = torch.full((n_groups,), -math.inf).scatter_reduce(0, groups, scores, "amax")
    metrics = {
        "critic/groups/zero_std_ratio": (lo == hi).float().mean().item(),
        "critic/groups/solve_none_ratio": (hi <= 0).float().mean().item(),
        "critic/groups/solve_all_ratio": (lo >= 1).float().mean().item(),
    }
    if responses is not None:
        mask = response_mask.bool() if response_mask is not None else torch.ones_like(responses, dtype=torch.bool)
        keyed = torch.cat([groups.unsqueeze(1), responses.cpu().long().masked_fill(~mask.cpu(), -1)], dim=1)
        distinct = torch.bincount(torch.unique(keyed, dim=0)[:, 0], minlength=n_groups).float()  # [groups]
        sizes = torch.bincount(groups, minlength=n_groups).float()
        metrics["response/distinct_ratio"] = (distinct / sizes).mean().item()
    return metrics


@ADVANTAGES.register("grpo", norm_by_std=True, epsilon=1e-6)
@uses_groups
def grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                    ctx: AdvantageContext | None = None, *, norm_by_std: bool = True, epsilon: float = 1e-6
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): ``(score - group mean) / (group std + eps)`` (unbiased std).

    ``norm_by_std=False`` is Dr. GRPO (Liu et al. 2025, arXiv:2503.20783; entry ``dr_grpo``). A group
    of one sample keeps its raw score (mean 0, std 1), as in verl's
    ``compute_grpo_outcome_advantage`` (core_algos.py:267 at b178a3c); TRL's
    ``scale_rewards="group"`` (grpo_trainer.py:2767) with ``epsilon=1e-4``.
    """
    if not isinstance(norm_by_std, bool) or not epsilon >= 0:
        raise ValueError(f"Need norm_by_std a bool and epsilon >= 0, got {norm_by_std!r}, {epsilon!r}")
    scores = scores.float()
    mean, std, count = _group_stats(scores, group_index(uids))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (torch.where(single, torch.ones_like(std), std) + epsilon)
    adv = adv.unsqueeze(-1) * response_mask  # [N, T]
    return adv, adv


ADVANTAGES.register_preset("dr_grpo", "grpo", description="Dr. GRPO: grpo without the std division",
                           norm_by_std=False)


@ADVANTAGES.register("rloo")
@uses_groups
def rloo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                    ctx: AdvantageContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): ``score - mean of the other samples of the group``.

    TRL's ``RLOOTrainer`` (rloo_trainer.py:1686-1690: ``rewards - (sum - rewards) / (count - 1)``)
    and verl's ``compute_rloo_outcome_advantage`` (core_algos.py:477 at b178a3c); a group of one
    keeps its raw score (verl).
    """
    scores = scores.float()
    mean, _, count = _group_stats(scores, group_index(uids))
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), scores)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@ADVANTAGES.register("reinforce")
@uses_groups
def reinforce_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                         ctx: AdvantageContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-mean baseline without std normalisation: ``score - group mean`` (nanochat style; same as ``dr_grpo``)."""
    return grpo_advantages(scores, response_mask, uids, norm_by_std=False)


@ADVANTAGES.register("opo")
@uses_groups
def opo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                   ctx: AdvantageContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv:2505.23585): the optimal baseline for a sequence-level reward,
    the length-weighted group mean ``sum_j |y_j| r_j / sum_j |y_j|``; a group of one keeps its score.
    verl's ``compute_opo_outcome_advantage`` (core_algos.py:529 at b178a3c)."""
    scores = scores.float()
    groups = group_index(uids).to(scores.device)
    lengths = response_mask.float().sum(-1)  # [N]
    zeros = torch.zeros(int(groups.max()) + 1 if len(groups) else 0, dtype=scores.dtype, device=scores.device)
    weighted = zeros.clone().index_add_(0, groups, lengths * scores)
    total = zeros.clone().index_add_(0, groups, lengths)
    count = zeros.clone().index_add_(0, groups, torch.ones_like(scores))
    baseline = torch.where(count[groups] > 1, weighted[groups] / total[groups].clamp(min=1e-8),
                           torch.zeros_like(scores))
    adv = (scores - baseline).unsqueeze(-1) * response_mask
    return adv, adv


@ADVANTAGES.register("reinforce_plus_plus", gamma=1.0, kl_in_reward_coef=0.0, kl_estimator="k1")
@requires(_kl_fields)
def reinforce_plus_plus_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                                   ctx: AdvantageContext | None = None, *, gamma: float = 1.0,
                                   kl_in_reward_coef: float = 0.0, kl_estimator: str = "k1"
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go of the token rewards (the
    score at the last token minus ``kl_in_reward_coef * KL`` per token), whitened over the whole
    batch's tokens (no group baseline). verl's ``compute_reinforce_plus_plus_outcome_advantage``
    (core_algos.py:583 at b178a3c) on ``apply_kl_penalty``'s token rewards."""
    _check_coefs(gamma=gamma, kl_in_reward_coef=kl_in_reward_coef)
    rewards = outcome_token_rewards(scores, response_mask, ctx, kl_in_reward_coef, kl_estimator,
                                    "reinforce_plus_plus")
    mask = response_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(len(rewards), dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]  # reset after the end of the response, as verl
    return masked_whiten(returns, mask) * mask, returns


@ADVANTAGES.register("reinforce_plus_plus_baseline", kl_in_reward_coef=0.0, kl_estimator="k1")
@uses_groups
@requires(_kl_fields)
def reinforce_plus_plus_baseline_advantages(scores: torch.Tensor, response_mask: torch.Tensor,
                                            uids: Sequence[object], ctx: AdvantageContext | None = None, *,
                                            kl_in_reward_coef: float = 0.0, kl_estimator: str = "k1"
                                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): the sequence reward (score minus the KL summed over
    its tokens) minus its group mean, then whitened over the whole batch's tokens. verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (core_algos.py:425 at b178a3c)."""
    _check_coefs(kl_in_reward_coef=kl_in_reward_coef)
    rewards = outcome_token_rewards(scores, response_mask, ctx, kl_in_reward_coef, kl_estimator,
                                    "reinforce_plus_plus_baseline")
    mask = response_mask.to(rewards.dtype)
    centred, _ = grpo_advantages(rewards.sum(-1), response_mask, uids, norm_by_std=False)  # [N, T]
    adv = masked_whiten(centred, mask) * mask
    return adv, adv


@ADVANTAGES.register("remax", kl_in_reward_coef=0.0, kl_estimator="k1")
@requires(lambda params: {"reward_baselines"} | _kl_fields(params))
def remax_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                     ctx: AdvantageContext | None = None, *, kl_in_reward_coef: float = 0.0, kl_estimator: str = "k1"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the return-to-go of the token rewards minus the score
    of a greedy response to the same prompt, ``ctx.reward_baselines [N]``. GRPO's ``rollout_step``
    issues that greedy generation and ``reward_step`` scores it whenever this estimator is chosen.
    verl's ``compute_remax_outcome_advantage`` (core_algos.py:622 at b178a3c): ``returns =
    reverse cumsum(rewards * mask)``, ``advantages = returns - baseline * mask``; no whitening."""
    _check_coefs(kl_in_reward_coef=kl_in_reward_coef)
    ctx = ctx or AdvantageContext()
    rewards = outcome_token_rewards(scores, response_mask, ctx, kl_in_reward_coef, kl_estimator, "remax")
    mask = response_mask.to(rewards.dtype)
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [N, T]
    baselines = ctx.get("reward_baselines", "remax").to(rewards.dtype)  # [N]
    return returns - baselines.unsqueeze(-1) * mask, returns


@ADVANTAGES.register("gae", gamma=1.0, lam=0.95, whiten=True, kl_in_reward_coef=0.0, kl_estimator="k1")
@requires(lambda params: {"values"} | _kl_fields(params))
def gae_estimator(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                  ctx: AdvantageContext | None = None, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True,
                  kl_in_reward_coef: float = 0.0, kl_estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over the outcome token rewards (the score at the last token, minus
    ``kl_in_reward_coef * KL`` per token, InstructGPT style) and the critic's ``ctx.values``: see
    :func:`gae_advantages` (verl's ``compute_gae_advantage_return``, core_algos.py:215 at b178a3c).
    Needs a critic: :class:`~rltrainer.PPO`."""
    _check_coefs(gamma=gamma, lam=lam, kl_in_reward_coef=kl_in_reward_coef)
    ctx = ctx or AdvantageContext()
    rewards = outcome_token_rewards(scores, response_mask, ctx, kl_in_reward_coef, kl_estimator, "gae")
    return gae_advantages(rewards, ctx.get("values", "gae"), response_mask, gamma, lam, whiten)


def _check_coefs(**values: float) -> None:
    for name, value in values.items():
        check_float(name, value, at_least=0, at_most=1 if name in ("gamma", "lam") else None)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (PPO).

    ``token_rewards``, ``values`` and ``response_mask`` are ``[N, T]``; padding positions are
    skipped (their value and reward are treated as absent). Returns whitened advantages (over
    the masked tokens, if ``whiten``) and the unwhitened returns ``advantages + values``.
    """
    N, T = token_rewards.shape
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    token_rewards, values = token_rewards.to(dtype), values.to(dtype)
    mask = response_mask.to(dtype)
    last_gae = torch.zeros(N, dtype=dtype, device=values.device)
    next_value = torch.zeros(N, dtype=dtype, device=values.device)
    adv = torch.zeros(N, T, dtype=dtype, device=values.device)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # on padding, carry the running values through unchanged
        last_gae = torch.where(mask[:, t] > 0, gae, last_gae)
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        adv[:, t] = gae * mask[:, t]
    returns = (adv + values) * mask
    if whiten:
        n = mask.sum().clamp(min=1)
        mean = (adv * mask).sum() / n
        var = ((adv - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)
        adv = (adv - mean) * torch.rsqrt(var + 1e-8) * mask
    return adv, returns


def required_fields(name: str, params: dict) -> set[str]:
    """The :class:`AdvantageContext` fields estimator ``name`` needs with ``params``."""
    fields = getattr(ADVANTAGES.get(name), "requires", None)
    return set(fields(params)) if fields is not None else set()


def check_advantage(name: str, params: dict) -> dict:
    """Return ``name``'s full parameters (its defaults updated by ``params``), or raise a ValueError
    naming what is wrong: an unknown name or parameter (listing what exists), or a bad value (the
    entry's own check, run on a group of two)."""
    full = ADVANTAGES.resolve(name, params)
    mask = torch.ones(2, 2)
    probes = {"reward_baselines": torch.zeros(2)}
    ctx = AdvantageContext(**{f: probes.get(f, torch.zeros(2, 2)) for f in required_fields(name, full)})
    ADVANTAGES.build(name, scores=torch.tensor([1.0, 0.0]), response_mask=mask, uids=["a", "a"], ctx=ctx, **full)
    return full
