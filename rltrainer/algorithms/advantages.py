"""Advantage estimators, one signature per family, looked up by name.

Outcome estimators (``grpo``, ``rloo``, ``reinforce``) take sequence scores ``[N]``, the
response mask ``[N, T]`` and the group id of each row, and broadcast one advantage per sequence
over its response tokens. ``gae`` takes per-token rewards and critic values.
All return ``(advantages [N, T], returns [N, T])``, zero on padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from rltrainer.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")


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


@ADVANTAGES.register("grpo")
def grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object],
                    norm_by_std: bool = True, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(score - group mean) / (group std + eps)``; ``norm_by_std=False`` is Dr. GRPO.

    A group of one sample keeps its raw score (mean 0, std 1), as in verl.
    """
    scores = scores.float()
    mean, std, count = _group_stats(scores, group_index(uids))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (torch.where(single, torch.ones_like(std), std) + epsilon)
    adv = adv.unsqueeze(-1) * response_mask  # [N, T]
    return adv, adv


@ADVANTAGES.register("rloo")
def rloo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: ``score - mean of the other samples of the group`` (RLOO)."""
    scores = scores.float()
    mean, _, count = _group_stats(scores, group_index(uids))
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), scores)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@ADVANTAGES.register("reinforce")
def reinforce_advantages(scores: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[object]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-mean baseline without std normalisation: ``score - group mean`` (nanochat style)."""
    return grpo_advantages(scores, response_mask, uids, norm_by_std=False)


@ADVANTAGES.register("gae")
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
