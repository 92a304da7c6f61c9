"""Policy and value losses. Each returns ``(loss, metrics)``; see :mod:`.aggregation` for how the
per-token matrix becomes a scalar that is independent of micro-batching."""

from __future__ import annotations

import torch

from rltrainer.algorithms.aggregation import aggregate, masked_sum_over
from rltrainer.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | None = None,
    global_rows: float | None = None,
    max_response_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with asymmetric clip range and dual clip (verl's ``vanilla``).

    ``ratio = exp(log_probs - old_log_probs)``; per token
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``, and for
    ``A < 0`` additionally capped at ``-A * clip_ratio_c`` (dual clip; ``None`` disables it).
    ``rollout_is_weights`` (off-policy rollout correction, see :mod:`.rollout_corr`) multiply that
    per-token loss before aggregation, as in verl. All inputs are ``[n, T]``. Metrics (token means,
    as shares of the global count): ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
    ``actor/ppo_kl``.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip (or None to disable it), got {clip_ratio_c}")
    mask = response_mask.to(log_probs.dtype)
    if global_tokens is None:
        global_tokens = mask.sum().clamp(min=1).item()
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).float()
    dual_clipped = torch.zeros_like(loss)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual_clipped = ((loss > cap) & (advantages < 0)).float()
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    pg_loss = aggregate(loss, mask, loss_agg_mode, global_tokens, global_rows, max_response_length)
    metrics = {
        "actor/pg_clipfrac": masked_sum_over(clipped, mask, global_tokens).detach(),
        "actor/pg_clipfrac_lower": masked_sum_over(dual_clipped, mask, global_tokens).detach(),
        "actor/ppo_kl": masked_sum_over(-log_ratio, mask, global_tokens).detach(),
    }
    return pg_loss, metrics


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | None = None,
    global_rows: float | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)`` (critic)."""
    mask = response_mask.to(values.dtype)
    if global_tokens is None:
        global_tokens = mask.sum().clamp(min=1).item()
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = aggregate(loss, mask, loss_agg_mode, global_tokens, global_rows, max_response_length)
    metrics = {"critic/vf_clipfrac": masked_sum_over((loss_clipped > loss_unclipped).float(), mask,
                                                     global_tokens).detach()}
    return vf_loss, metrics
