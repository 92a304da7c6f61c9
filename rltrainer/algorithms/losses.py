"""Policy losses (registry entries) and the critic's value loss.

Every entry of :data:`POLICY_LOSSES` is called with one signature::

    fn(log_probs [n, T], old_log_probs [n, T], advantages [n, T], response_mask [n, T],
       ctx: LossContext, **params) -> (loss, metrics)

``ctx`` carries what is shared by all entries (the aggregation mode, the whole mini-batch's token
and row counts, the rollout-correction IS weights); ``params`` are the entry's own parameters,
registered with it as defaults (``POLICY_LOSSES.defaults(name)``) and overridden by
``GRPO(policy_loss_kwargs=...)``. Metrics keep verl's names (``actor/pg_clipfrac``,
``actor/pg_clipfrac_lower``, ``actor/ppo_kl``) and are token means taken as shares of the global
token count, so summing them over micro-batches gives the mini-batch's value. See
:mod:`.aggregation` for how the per-token matrix becomes a scalar independent of micro-batching.

A loss whose token selection needs statistics of the whole batch (Clip-Cov, KL-Cov) carries a
``prepare`` function (see :func:`prepared_by`): ``advantage_step`` runs it once per batch on the
controller and the result travels with every micro-batch in ``ctx.extras``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrainer.algorithms.aggregation import aggregate, masked_sum_over
from rltrainer.registry import Registry
from rltrainer.values import check_float

POLICY_LOSSES: Registry = Registry("policy loss")

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossContext:
    """What every policy loss gets besides its four tensors and its own parameters."""

    loss_agg_mode: str = "token-mean"
    global_tokens: float | None = None  # response tokens of the whole mini-batch (None: this one's)
    global_rows: float | None = None  # rows of the whole mini-batch (None: this one's)
    max_response_length: int | None = None  # the generation budget (seq-mean-token-sum-norm)
    rollout_is_weights: torch.Tensor | None = None  # [n, T] off-policy IS weights, detached
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)  # [n, T] each, from a loss's prepare

    def tokens(self, mask: torch.Tensor) -> float:
        return self.global_tokens if self.global_tokens is not None else max(float(mask.sum()), 1.0)

    def finish(self, loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Weight the per-token ``loss [n, T]`` by the IS weights (verl: before aggregating), aggregate."""
        if self.rollout_is_weights is not None:
            loss = loss * self.rollout_is_weights
        return aggregate(loss, mask, self.loss_agg_mode, self.tokens(mask), self.global_rows,
                         self.max_response_length)

    def mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A token-mean metric's share from this micro-batch (detached)."""
        return masked_sum_over(values.detach().to(mask.dtype), mask, self.tokens(mask)).detach()


def prepared_by(prepare: Callable[..., dict[str, torch.Tensor]]) -> Callable[[Callable], Callable]:
    """Attach a batch-level ``prepare(old_log_probs [N, T], advantages [N, T], response_mask [N, T],
    **params) -> {name: [N, T]}`` to a loss entry; its outputs reach the loss as ``ctx.extras``."""

    def decorator(fn: Callable) -> Callable:
        fn.prepare = prepare  # type: ignore[attr-defined]
        return fn

    return decorator


def _ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_ratio, ratio)`` with the log-ratio clamped to [-20, 20] as in verl."""
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    return log_ratio, log_ratio.exp()


def _check_clip(low: float | None, high: float, low_below_one: bool = True) -> None:
    given = (high,) if low is None else (low, high)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in given)
    if not numbers or high < 0 or (low is not None and (low < 0 or (low_below_one and low >= 1))):
        raise ValueError(f"Need clip_ratio_low in [0, 1) and clip_ratio_high >= 0, got clip_ratio_low={low!r}, "
                         f"clip_ratio_high={high!r}; e.g. 0.2 and 0.28 (DAPO's clip-higher)")


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        check_float(name, value, above=0)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1-low, 1+high))`` ``[n, T]``, and the two terms."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), unclipped, clipped


# -- PPO clip --------------------------------------------------------------------------------------
@POLICY_LOSSES.register("ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
def ppo_clip_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, ctx: LossContext | None = None, *, clip_ratio_low: float = 0.2,
                  clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate with asymmetric clip range and dual clip (verl's ``vanilla``,
    ``compute_policy_loss_vanilla``, core_algos.py:1160 at b178a3c; TRL ``loss_type="grpo"/"dapo"``,
    grpo_trainer.py:3113-3120).

    ``ratio = exp(log_probs - old_log_probs)``; per token
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``, and for
    ``A < 0`` additionally capped at ``-A * clip_ratio_c`` (dual clip, Ye et al. 2019; ``None``
    disables it). DAPO's clip-higher is ``clip_ratio_high=0.28``. Metrics: ``actor/pg_clipfrac``,
    ``actor/pg_clipfrac_lower`` (dual-clipped share), ``actor/ppo_kl``.
    """
    ctx = ctx or LossContext()
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip (or None to disable it), got {clip_ratio_c}")
    mask = response_mask.to(log_probs.dtype)
    log_ratio, ratio = _ratio(log_probs, old_log_probs)
    loss, unclipped, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    dual_clipped = torch.zeros_like(loss)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual_clipped = ((loss > cap) & (advantages < 0)).float()
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    metrics = {"actor/pg_clipfrac": ctx.mean((clipped > unclipped).float(), mask),
               "actor/pg_clipfrac_lower": ctx.mean(dual_clipped, mask),
               "actor/ppo_kl": ctx.mean(-log_ratio, mask)}
    return ctx.finish(loss, mask), metrics


# -- GSPO ------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
def gspo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, ctx: LossContext | None = None, *, clip_ratio_low: float = 3e-4,
              clip_ratio_high: float = 4e-4) -> tuple[torch.Tensor, Metrics]:
    """GSPO: PPO's clip on the sequence-level ratio (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7).

    ``s_i = exp(mean_t(log_probs - old_log_probs))`` over row ``i``'s response tokens; per token
    ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))`` with ``s_it = sg[s_i] * pi / sg[pi]``
    (value ``s_i``, gradient ``s_i * grad log pi_t``), log clamped at 10: verl's
    ``compute_policy_loss_gspo`` (core_algos.py:1254 at b178a3c); equal in value and gradient to
    TRL's ``importance_sampling_level="sequence"`` (grpo_trainer.py:3086-3088). Defaults are the
    paper's clip range (3e-4, 4e-4). verl forces ``seq-mean-token-mean``; here the module's
    ``loss_agg_mode`` applies (the paper's is ``seq-mean-token-mean``). The ratio only needs its own
    row, and micro-batches split by rows, so micro-batching never changes it.
    """
    ctx = ctx or LossContext()
    _check_clip(clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [n]
    log_s = (log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)  # [n, T]
    loss, unclipped, clipped = _clipped_surrogate(log_s.exp(), advantages, clip_ratio_low, clip_ratio_high)
    metrics = {"actor/pg_clipfrac": ctx.mean((clipped > unclipped).float(), mask),
               "actor/ppo_kl": ctx.mean(-log_ratio, mask)}
    return ctx.finish(loss, mask), metrics


# -- CISPO -----------------------------------------------------------------------------------------
@POLICY_LOSSES.register("cispo", clip_ratio_low=None, clip_ratio_high=4.0)
def cispo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, ctx: LossContext | None = None, *, clip_ratio_low: float | None = None,
               clip_ratio_high: float = 4.0) -> tuple[torch.Tensor, Metrics]:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient IS ratio (MiniMax-M1, arXiv:2506.13585, eq. 4).

    Per token ``-sg[clip(r, 1 - low, 1 + high)] * A * log_probs``: every token keeps a gradient
    (none is clipped away), weighted at most ``1 + high``. ``clip_ratio_low=None``: no lower bound
    (the paper's setting). verl's ``compute_policy_loss_cispo`` (core_algos.py:1722 at b178a3c);
    TRL's ``loss_type="cispo"`` (grpo_trainer.py:3109-3111) is ``clip_ratio_low=None`` with
    ``epsilon_high = 1 + clip_ratio_high`` (TRL's recommended 5.0 is the default here).
    """
    ctx = ctx or LossContext()
    _check_clip(clip_ratio_low, clip_ratio_high, low_below_one=False)
    mask = response_mask.to(log_probs.dtype)
    log_ratio, ratio = _ratio(log_probs, old_log_probs)
    low = None if clip_ratio_low is None else 1.0 - clip_ratio_low
    weight = ratio.clamp(min=low, max=1.0 + clip_ratio_high).detach()
    loss = -weight * advantages * log_probs
    metrics = {"actor/pg_clipfrac": ctx.mean((ratio != weight).float(), mask),
               "actor/ppo_kl": ctx.mean(-log_ratio, mask)}
    return ctx.finish(loss, mask), metrics


# -- SAPO ------------------------------------------------------------------------------------------
@POLICY_LOSSES.register("sapo", tau_pos=1.0, tau_neg=1.05)
def sapo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, ctx: LossContext | None = None, *, tau_pos: float = 1.0,
              tau_neg: float = 1.05) -> tuple[torch.Tensor, Metrics]:
    """SAPO: a soft, temperature-controlled gate instead of the hard clip (Gao et al. 2025, arXiv:2511.20347).

    Per token ``-f(r) * A`` with ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``, ``tau = tau_pos`` if
    ``A > 0`` else ``tau_neg`` (gradient ``A * r * 4 sigma(1 - sigma)``: 1 at ``r = 1``, fading off
    it). verl's ``compute_policy_loss_sapo`` (core_algos.py:1330 at b178a3c); TRL's
    ``loss_type="sapo"`` (grpo_trainer.py:3121-3124), whose defaults (1.0, 1.05) these are.
    """
    ctx = ctx or LossContext()
    _check_positive(tau_pos=tau_pos, tau_neg=tau_neg)
    mask = response_mask.to(log_probs.dtype)
    log_ratio, ratio = _ratio(log_probs, old_log_probs)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    return ctx.finish(loss, mask), {"actor/ppo_kl": ctx.mean(-log_ratio, mask)}


# -- DPPO ------------------------------------------------------------------------------------------
def _dppo(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          ctx: LossContext, valid: torch.Tensor, clip_ratio_c: float) -> tuple[torch.Tensor, Metrics]:
    """``-A * sg[min(r, c)] * log_probs`` on the tokens ``valid`` keeps (a 0/1 ``[n, T]``)."""
    log_ratio, ratio = _ratio(log_probs, old_log_probs)
    valid = valid.detach().to(log_probs.dtype)
    loss = -advantages * ratio.clamp(max=clip_ratio_c).detach() * log_probs * valid
    metrics = {"actor/pg_clipfrac": ctx.mean(1.0 - valid, mask),
               "actor/pg_clipfrac_lower": ctx.mean((ratio > clip_ratio_c).float() * valid, mask),
               "actor/ppo_kl": ctx.mean(-log_ratio, mask)}
    return ctx.finish(loss, mask), metrics


@POLICY_LOSSES.register("dppo_tv", clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=20.0)
def dppo_tv_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, ctx: LossContext | None = None, *, clip_ratio_low: float = 0.15,
                 clip_ratio_high: float = 0.15, clip_ratio_c: float = 20.0) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV: mask tokens whose probability moved too far, instead of clipping the ratio
    (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879).

    With ``p = exp(log_probs)``, ``p_old = exp(old_log_probs)``: a token is kept if
    ``p - p_old <= clip_ratio_high`` (``A > 0``) or ``p - p_old >= -clip_ratio_low`` (``A <= 0``);
    per token ``-A * sg[min(r, clip_ratio_c)] * log_probs`` on the kept tokens (truncated IS,
    the paper's section 5.4). verl's ``compute_policy_loss_dppo_tv`` (core_algos.py, added after
    b178a3c: ``register_policy_loss("dppo_tv")``); the thresholds' defaults are this repo's.
    ``actor/pg_clipfrac``: share masked; ``actor/pg_clipfrac_lower``: share truncated.
    """
    ctx = ctx or LossContext()
    _check_positive(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    shift = log_probs.exp() - old_log_probs.exp()  # [n, T]
    valid = torch.where(advantages > 0, shift <= clip_ratio_high, shift >= -clip_ratio_low)
    return _dppo(log_probs, old_log_probs, advantages, response_mask.to(log_probs.dtype), ctx, valid, clip_ratio_c)


@POLICY_LOSSES.register("dppo_kl", clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=20.0)
def dppo_kl_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, ctx: LossContext | None = None, *, clip_ratio_low: float = 0.05,
                 clip_ratio_high: float = 0.05, clip_ratio_c: float = 20.0) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (arXiv:2602.04879): as :func:`dppo_tv_loss` with the binary KL
    ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` as the divergence;
    a token is masked if that exceeds ``clip_ratio_high`` while ``p`` rose (``A > 0``), or
    ``clip_ratio_low`` while ``p`` fell (``A <= 0``). verl's ``compute_policy_loss_dppo_kl``
    (core_algos.py, added after b178a3c)."""
    ctx = ctx or LossContext()
    _check_positive(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    p, p_old = log_probs.exp(), old_log_probs.exp()
    kl = p_old * (old_log_probs - log_probs) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(advantages > 0, (kl <= clip_ratio_high) | (p <= p_old), (kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(log_probs, old_log_probs, advantages, response_mask.to(log_probs.dtype), ctx, valid, clip_ratio_c)


# -- Clip-Cov and KL-Cov ---------------------------------------------------------------------------
def token_covariance(old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean A) * (log pi - mean log pi)`` per token ``[N, T]``, means over the masked tokens."""
    n = mask.sum().clamp(min=1)
    return (advantages - (advantages * mask).sum() / n) * (old_log_probs - (old_log_probs * mask).sum() / n)


def clip_cov_select(old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_cov_ratio: float = 2e-4,
                    clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                    generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Clip-Cov's selection: ``max(1, int(clip_cov_ratio * tokens))`` tokens drawn at random among those
    with covariance in ``(clip_cov_lb, clip_cov_ub)``; ``cov_keep [N, T]`` is 0 there, 1 elsewhere."""
    _check_positive(clip_cov_ratio=clip_cov_ratio)
    mask = response_mask.to(advantages.dtype)
    cov = token_covariance(old_log_probs.detach(), advantages, mask)
    candidates = torch.nonzero((cov > clip_cov_lb) & (cov < clip_cov_ub) & (mask > 0))  # [k, 2]
    count = max(int(clip_cov_ratio * mask.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
    keep = torch.ones_like(mask)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return {"cov_keep": keep}


@POLICY_LOSSES.register("clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=2e-4, clip_cov_lb=1.0,
                        clip_cov_ub=5.0)
@prepared_by(clip_cov_select)
def clip_cov_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, ctx: LossContext | None = None, *, clip_ratio_low: float = 0.2,
                  clip_ratio_high: float = 0.2, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0,
                  clip_cov_ub: float = 5.0) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617):
    PPO's clipped surrogate with the gradient of a few high-covariance tokens cut off.

    Per token ``max(-A r, -A clip(r, 1 - low, 1 + high)) * cov_keep``, ``cov_keep`` from
    :func:`clip_cov_select` (in ``ctx.extras``). verl's ``compute_policy_loss_clip_cov``
    (core_algos.py:1451 at b178a3c) selects per micro-batch from the current log-probs, excluding
    tokens already clipped; here the selection is made once per batch on the controller from
    ``old_log_probs`` (equal to the current ones at the first step on fresh rollouts, where nothing is
    clipped yet), so micro-batching does not change it. ``actor/pg_clipfrac``: share cut off.
    """
    ctx = ctx or LossContext()
    _check_clip(clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_probs.dtype)
    log_ratio, ratio = _ratio(log_probs, old_log_probs)
    keep = ctx.extras["cov_keep"] if "cov_keep" in ctx.extras else torch.ones_like(mask)
    loss, _, _ = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    metrics = {"actor/pg_clipfrac": ctx.mean(1.0 - keep, mask), "actor/ppo_kl": ctx.mean(-log_ratio, mask)}
    return ctx.finish(loss * keep, mask), metrics


def kl_cov_select(old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                  kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1) -> dict[str, torch.Tensor]:
    """KL-Cov's selection: the ``max(1, int(kl_cov_ratio * tokens))`` tokens of largest covariance
    (``cov_selected [N, T]``: 1 there)."""
    _check_positive(kl_cov_ratio=kl_cov_ratio)
    mask = response_mask.to(advantages.dtype)
    valid = mask.reshape(-1) > 0
    cov = token_covariance(old_log_probs.detach(), advantages, mask).reshape(-1)
    selected = torch.zeros_like(cov)
    if valid.any():
        count = max(1, int(valid.sum().item() * kl_cov_ratio))
        index = torch.nonzero(valid, as_tuple=True)[0]
        selected[index[torch.topk(cov[valid], min(count, len(index))).indices]] = 1.0
    return {"cov_selected": selected.reshape(mask.shape)}


@POLICY_LOSSES.register("kl_cov", kl_cov_ratio=2e-4, ppo_kl_coef=0.1)
@prepared_by(kl_cov_select)
def kl_cov_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, ctx: LossContext | None = None, *, kl_cov_ratio: float = 2e-4,
                ppo_kl_coef: float = 0.1) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (arXiv:2505.22617): the unclipped surrogate ``-A r``, plus ``ppo_kl_coef * |log r|``
    on the few tokens of largest covariance (``cov_selected`` from :func:`kl_cov_select`).

    verl's ``compute_policy_loss_kl_cov`` (core_algos.py:1556 at b178a3c; ``ppo_kl_coef`` default
    0.1 from verl's ``PolicyLossConfig``), with the selection made once per batch from
    ``old_log_probs`` (see :func:`clip_cov_loss`). ``actor/ppo_kl`` is verl's: mean ``|log r|``.
    """
    ctx = ctx or LossContext()
    _check_positive(ppo_kl_coef=ppo_kl_coef)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    selected = ctx.extras["cov_selected"] if "cov_selected" in ctx.extras else torch.zeros_like(mask)
    loss = -advantages * log_ratio.exp() + ppo_kl_coef * log_ratio.abs() * selected
    return ctx.finish(loss, mask), {"actor/ppo_kl": ctx.mean(log_ratio.abs(), mask)}


# -- the critic ------------------------------------------------------------------------------------
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


def check_policy_loss(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Return ``name``'s full parameters (its defaults updated by ``params``), or raise a ValueError
    naming what is wrong: an unknown name or parameter (listing what exists), or a bad value (the
    entry's own check, run on a two-token input)."""
    full = POLICY_LOSSES.resolve(name, params)
    fn = POLICY_LOSSES.get(name)
    probe = torch.full((1, 2), -0.5)
    mask, adv = torch.ones(1, 2), torch.tensor([[1.0, -1.0]])
    prepare = getattr(fn, "prepare", None)
    with torch.random.fork_rng(devices=[]):  # a prepare may draw (Clip-Cov): leave the caller's RNG as it was
        extras = prepare(probe, adv, mask, **full) if prepare is not None else {}
        fn(probe, probe, adv, mask, LossContext(extras=extras), **full)
    return full
