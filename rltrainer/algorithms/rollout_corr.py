"""Off-policy rollout correction: importance-sampling (IS) weights and rejection masks between the
policy that generated a rollout and the trainer's policy, as in verl's rollout correction.

A rollout is off-policy when it was generated with weights one or more versions old (async
pipelines) or by an engine whose log-probs differ from the trainer's (vLLM/SGLang in bf16). With
``old_log_probs`` (the trainer's policy before the update) and ``rollout_log_probs`` (the engine's)
per token, the IS ratio of a response token is

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_log_probs - rollout_log_probs)

Every entry of :data:`ROLLOUT_CORRECTIONS` is called with one signature::

    fn(old_log_probs [N, T], rollout_log_probs [N, T], response_mask [N, T], **params) -> Correction

and returns ``Correction(weights, response_mask, metrics)``: IS weights ``[N, T]`` (detached, 0 on
padding) or ``None``, the response mask with rejected tokens set to 0, and metrics named as verl
names them (without the ``rollout_corr/`` prefix the caller adds), as 0-dim tensors so that a
correction running inside the update on an accelerator never waits for the device. An entry's parameters and their
defaults are registered with it; build one with ``ROLLOUT_CORRECTIONS.build(name, old_log_probs=...,
rollout_log_probs=..., response_mask=..., **params)``.

The entries, their parameters (defaults) and verl's equivalent (``algorithm.rollout_correction``):

- ``token_tis`` (threshold=2.0): ``rollout_is="token"`` (Token-TIS).
- ``seq_tis`` (threshold=2.0): ``rollout_is="sequence"`` (Seq-TIS).
- ``token_rs`` (low=0.5, high=2.0): ``rollout_rs="token_k1"``.
- ``seq_rs`` (low=0.5, high=2.0): ``rollout_rs="seq_sum_k1"``.
- ``geo_rs`` (low=0.999, high=1.001): ``rollout_rs="seq_mean_k1"`` (Geo-RS).
- ``token_mis`` (threshold=2.0, low=0.5, high=2.0): ``rollout_is="token"``, ``rollout_rs="token_k1"``.
- ``seq_mis`` (threshold=2.0, low=0.5, high=2.0): ``rollout_is="sequence"``,
  ``rollout_rs="seq_sum_k1"`` (Seq-MIS, verl's ``decoupled_seq_is_rs``).
- ``geo_rs_token_tis`` (threshold=2.0, low=0.999, high=1.001): ``rollout_is="token"``,
  ``rollout_rs="seq_mean_k1"`` (verl's ``decoupled_geo_rs_token_tis``).
- ``icepop``: ``token_mis`` with threshold=5.0, low=0.5, high=5.0 (IcePop's ``alpha, beta``:
  tokens with ``rho`` outside ``[0.5, 5]`` dropped, the others weighted by ``rho``).

Bounds ``low``/``high`` are on the IS ratio ``rho`` (kept: ``low <= rho <= high``). verl's ``*_k1``
thresholds ``"L_U"`` bound the inverse ratio ``pi_rollout / pi_old`` (its statistic is
``k1 = -log rho``), so verl's ``"L_U"`` is ``low=1/U, high=1/L`` here; symmetric bounds
(``L = 1/U``, e.g. verl's ``"0.5_2.0"``) are the same in both.

As in verl, log-ratios are clamped to ``[-20, 20]`` before ``exp`` (per token, or the sequence's
sum for sequence-level IS weights), and the weights are detached: they change the measure, not the
objective. Padding never counts.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from rltrainer.registry import Registry
from rltrainer.values import check_float

ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction")

#: log-ratios are clamped to +-SAFETY_BOUND before exp (exp(20) is about 4.9e8), as in verl.
SAFETY_BOUND = 20.0


class Correction(NamedTuple):
    """What a rollout correction returns."""

    weights: torch.Tensor | None  # [N, T] IS weights, detached, 0 on padding; None: rejection only
    response_mask: torch.Tensor  # [N, T] the input mask with rejected tokens set to 0
    metrics: dict[str, torch.Tensor]  # 0-dim tensors, verl's names, without the "rollout_corr/" prefix


def check_rollout_correction(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Return ``name``'s full parameters (its defaults updated by ``params``), or raise a ValueError
    naming what is wrong: an unknown name (listing the names), an unknown parameter (listing the
    entry's parameters) or a bad value (the entry's own check, run on a one-token input)."""
    full = ROLLOUT_CORRECTIONS.resolve(name, params)  # an unknown name or parameter raises, listing them
    one = torch.zeros(1, 1)
    ROLLOUT_CORRECTIONS.build(name, old_log_probs=one, rollout_log_probs=one, response_mask=torch.ones(1, 1),
                              **params)
    return full


def _check_threshold(threshold: float) -> None:
    check_float("threshold", threshold, above=0, meaning="the IS weight cap; typical: 2.0")


def _check_bounds(low: float, high: float) -> None:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not 0 < low < high:
        raise ValueError(f"Need ratio bounds 0 < low < high, got low={low!r}, high={high!r}; "
                         f"e.g. low=0.5, high=2.0")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; values outside the mask (even inf/nan) never count."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum / (mask count + 1e-8)``, verl's ``masked_mean``."""
    return masked_sum(values, mask, dim) / (mask.sum(dim=dim) + 1e-8)


# -- the two building blocks ---------------------------------------------------------------------
def truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated IS weights ``[N, T]`` and their metrics (verl's ``compute_rollout_correction_weights``
    without batch normalisation, and ``compute_is_metrics``).

    ``level="token"``: ``w_t = min(exp(clamp(log rho_t, +-20)), threshold)``.
    ``level="sequence"``: ``w = min(exp(clamp(sum_t log rho_t, +-20)), threshold)`` on every token.
    Metrics are of the weights before truncation: ``rollout_is_mean``, ``_max``, ``_min``,
    ``rollout_is_ratio_fraction_high`` / ``_low`` (share above ``threshold`` / below ``1/threshold``;
    of sequences for ``"sequence"``), ``rollout_is_eff_sample_size``.
    """
    _check_threshold(threshold)
    if level == "token":
        log_rho = log_ratio  # [N, T]
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    elif level == "sequence":
        log_rho = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # [N, 1]: log of the product
        raw = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"IS level must be 'token' or 'sequence', got {level!r}")
    raw = raw * mask  # [N, T], 0 on padding
    metrics = _is_metrics(raw, log_rho, mask, level, threshold)
    return raw.clamp(max=threshold).detach(), metrics


def _is_metrics(raw: torch.Tensor, log_rho: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
                ) -> dict[str, torch.Tensor]:
    lower = 1.0 / threshold
    if level == "sequence":  # in log space, over all rows
        is_max = log_rho.max().clamp(max=SAFETY_BOUND).exp()
        is_min = log_rho.min().exp()
        high = (log_rho > torch.log(torch.tensor(threshold))).float().mean()
        low = (log_rho < torch.log(torch.tensor(lower))).float().mean()
    else:
        keep = mask.bool()
        is_max = raw.masked_fill(~keep, float("-inf")).max()
        is_min = raw.masked_fill(~keep, float("inf")).min()
        high = masked_mean((raw > threshold).float(), mask)
        low = masked_mean((raw < lower).float(), mask)
    # effective sample size, in [0, 1]: 1 / mean(w_n^2) with w_n = w / mean(w), w clamped to [1/C, C]
    bounded = raw.clamp(min=lower, max=threshold)
    normalized = bounded / (masked_mean(bounded, mask) + 1e-8)
    return {
        "rollout_is_mean": masked_mean(raw, mask),
        "rollout_is_max": is_max,
        "rollout_is_min": is_min,
        "rollout_is_ratio_fraction_high": high,
        "rollout_is_ratio_fraction_low": low,
        "rollout_is_eff_sample_size": 1.0 / masked_mean(normalized.square(), mask),
    }


def ratio_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, low: float, high: float
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mask with tokens (or whole sequences) whose ratio lies outside ``[low, high]`` set to 0
    (verl's ``compute_rollout_rejection_mask`` for the ``*_k1`` options), and its metrics.

    With ``l_t = clamp(log rho_t, +-20)``, the statistic is ``l_t`` (``level="token"``),
    ``sum_t l_t`` (``"sequence"``: the product of the ratios) or ``mean_t l_t`` (``"geometric"``: the
    geometric mean of the ratios); kept where ``log(low) <= statistic <= log(high)``. Metrics:
    ``rollout_rs_masked_fraction`` (share of response tokens rejected) and
    ``rollout_rs_seq_masked_fraction`` (share of rows with a rejected token).
    """
    _check_bounds(low, high)
    clamped = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if level == "token":
        stat = clamped  # [N, T]
    elif level == "sequence":
        stat = masked_sum(clamped, mask, dim=-1).unsqueeze(-1)  # [N, 1]
    elif level == "geometric":
        stat = masked_mean(clamped, mask, dim=-1).unsqueeze(-1)  # [N, 1]
    else:
        raise ValueError(f"rejection level must be 'token', 'sequence' or 'geometric', got {level!r}")
    keep = ((stat >= math.log(low)) & (stat <= math.log(high))).expand_as(log_ratio)  # [N, T]
    in_response = mask.bool()
    metrics = {
        "rollout_rs_masked_fraction": masked_mean((~keep).to(log_ratio.dtype), mask),
        "rollout_rs_seq_masked_fraction": (~keep & in_response).any(dim=-1).float().mean(),
    }
    return (mask * keep).to(mask.dtype), metrics


# -- the entries -----------------------------------------------------------------------------------
@ROLLOUT_CORRECTIONS.register("token_tis", threshold=2.0)
def token_tis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
              threshold: float) -> Correction:
    """Token-level truncated IS (Token-TIS).

    ``w_t = min(rho_t, threshold)`` per token; nothing rejected.
    """
    weights, metrics = truncated_is_weights(old_log_probs - rollout_log_probs, response_mask, "token", threshold)
    return Correction(weights, response_mask, metrics)


@ROLLOUT_CORRECTIONS.register("seq_tis", threshold=2.0)
def seq_tis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
            threshold: float) -> Correction:
    """Sequence-level truncated IS (Seq-TIS).

    ``w = min(prod_t rho_t, threshold)`` on every token of a sequence, the product formed as
    ``exp(clamp(sum_t log rho_t, +-20))``; nothing rejected.
    """
    weights, metrics = truncated_is_weights(old_log_probs - rollout_log_probs, response_mask, "sequence", threshold)
    return Correction(weights, response_mask, metrics)


@ROLLOUT_CORRECTIONS.register("token_rs", low=0.5, high=2.0)
def token_rs(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
             low: float, high: float) -> Correction:
    """Token-level rejection.

    A token is dropped from the loss unless ``low <= rho_t <= high``; no weights.
    """
    mask, metrics = ratio_rejection_mask(old_log_probs - rollout_log_probs, response_mask, "token", low, high)
    return Correction(None, mask, metrics)


@ROLLOUT_CORRECTIONS.register("seq_rs", low=0.5, high=2.0)
def seq_rs(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
           low: float, high: float) -> Correction:
    """Sequence-level rejection.

    A sequence is dropped unless ``low <= prod_t rho_t <= high`` (``log rho_t`` clamped to +-20 per
    token, then summed); no weights.
    """
    mask, metrics = ratio_rejection_mask(old_log_probs - rollout_log_probs, response_mask, "sequence", low, high)
    return Correction(None, mask, metrics)


@ROLLOUT_CORRECTIONS.register("geo_rs", low=0.999, high=1.001)
def geo_rs(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
           low: float, high: float) -> Correction:
    """Geometric-mean sequence rejection (Geo-RS).

    A sequence is dropped unless ``low <= exp(mean_t log rho_t) <= high``, the geometric mean of its
    ratios (``log rho_t`` clamped to +-20); length-invariant, so the bounds are tight (+-0.1 %).
    """
    mask, metrics = ratio_rejection_mask(old_log_probs - rollout_log_probs, response_mask, "geometric", low, high)
    return Correction(None, mask, metrics)


@ROLLOUT_CORRECTIONS.register("token_mis", threshold=2.0, low=0.5, high=2.0)
def token_mis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
              threshold: float, low: float, high: float) -> Correction:
    """Token-level masked IS (Token-MIS).

    Weights ``min(rho_t, threshold)``, and tokens with ``rho_t`` outside ``[low, high]`` dropped; with
    ``threshold >= high`` the kept tokens' weights are ``rho_t`` itself.
    """
    log_ratio = old_log_probs - rollout_log_probs
    weights, metrics = truncated_is_weights(log_ratio, response_mask, "token", threshold)
    mask, rs_metrics = ratio_rejection_mask(log_ratio, response_mask, "token", low, high)
    return Correction(weights, mask, {**metrics, **rs_metrics})


@ROLLOUT_CORRECTIONS.register("seq_mis", threshold=2.0, low=0.5, high=2.0)
def seq_mis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, *,
            threshold: float, low: float, high: float) -> Correction:
    """Sequence-level masked IS (Seq-MIS).

    Weights ``min(prod_t rho_t, threshold)`` (as ``seq_tis``), and sequences with ``prod_t rho_t``
    outside ``[low, high]`` dropped (as ``seq_rs``).
    """
    log_ratio = old_log_probs - rollout_log_probs
    weights, metrics = truncated_is_weights(log_ratio, response_mask, "sequence", threshold)
    mask, rs_metrics = ratio_rejection_mask(log_ratio, response_mask, "sequence", low, high)
    return Correction(weights, mask, {**metrics, **rs_metrics})


@ROLLOUT_CORRECTIONS.register("geo_rs_token_tis", threshold=2.0, low=0.999, high=1.001)
def geo_rs_token_tis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                     *, threshold: float, low: float, high: float) -> Correction:
    """Geometric-mean sequence rejection with token-level truncated IS (Geo-RS-Token-TIS).

    Weights ``min(rho_t, threshold)`` (as ``token_tis``), and sequences with
    ``exp(mean_t log rho_t)`` outside ``[low, high]`` dropped (as ``geo_rs``).
    """
    log_ratio = old_log_probs - rollout_log_probs
    weights, metrics = truncated_is_weights(log_ratio, response_mask, "token", threshold)
    mask, rs_metrics = ratio_rejection_mask(log_ratio, response_mask, "geometric", low, high)
    return Correction(weights, mask, {**metrics, **rs_metrics})


ROLLOUT_CORRECTIONS.register_preset(
    "icepop", "token_mis", threshold=5.0, low=0.5, high=5.0,
    description="IcePop: tokens with rho outside [0.5, 5] dropped, the others weighted by rho")


def rejects(name: str, params: dict[str, Any]) -> bool:
    """Whether correction ``name`` with ``params`` can drop tokens: probed on two rows whose every
    ratio is at the clamp (``exp(+-20)``), which any rejection bound excludes. A correction that
    only weights keeps the loss's token count, so it can run inside the update (see
    :func:`share_of_batch`); one that rejects changes the count the loss divides by and must run
    before it."""
    bound = torch.full((2, 3), SAFETY_BOUND)
    bound[1] = -SAFETY_BOUND
    mask = torch.ones_like(bound)
    out = ROLLOUT_CORRECTIONS.build(name, old_log_probs=bound, rollout_log_probs=torch.zeros_like(bound),
                                    response_mask=mask, **params)
    return not torch.equal(out.response_mask, mask)


#: How a metric of this module adds up over micro-batches and ranks when the correction runs inside
#: the update (:func:`share_of_batch`): ``"token"`` and ``"row"`` means as shares of the global
#: count, ``"max"`` / ``"min"`` by the strategies' max / min reduction of ``*_max`` / ``*_min``.
METRIC_KINDS: dict[str, str] = {
    "kl": "token", "k3_kl": "token", "chi2_token": "token", "chi2_seq": "row", "training_ppl": "row",
    "rollout_ppl": "row", "log_ppl_diff": "row", "rollout_is_mean": "token", "rollout_is_max": "max",
    "rollout_is_min": "min", "rollout_is_ratio_fraction_high": "token", "rollout_is_ratio_fraction_low": "token",
    "rollout_is_eff_sample_size": "token", "rollout_rs_masked_fraction": "token",
    "rollout_rs_seq_masked_fraction": "row",
}


def share_of_batch(metrics: dict[str, torch.Tensor], response_mask: torch.Tensor, global_tokens: float,
                   global_rows: float) -> dict[str, torch.Tensor]:
    """One micro-batch's share of batch-level metrics: a token mean times the micro-batch's share of
    the response tokens, a row mean times its share of the rows, a max or min as it is. The shares
    of all micro-batches on all ranks add up to the batch's value, exactly for means; the effective
    sample size and a sequence-level IS correction's fractions come out as the token-weighted mean
    of the micro-batches' values (exact when each rank's batch is one micro-batch). Names not in
    :data:`METRIC_KINDS` count as token means."""
    tokens, rows = response_mask.sum(), response_mask.shape[0]
    out = {}
    for name, value in metrics.items():
        kind = METRIC_KINDS.get(name, "token")
        out[name] = value * (tokens / global_tokens) if kind == "token" else (
            value * (rows / global_rows) if kind == "row" else value)
    return out


# -- diagnostics -------------------------------------------------------------------------------------
def mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
    """How far the rollout policy is from the trainer's (verl's ``compute_offpolicy_metrics``), over
    response tokens; all inputs ``[N, T]``. With ``l_t = log rho_t = old - rollout``:

    - ``kl``: ``KL(pi_rollout || pi_old)`` by k1, the token mean of ``-l_t``;
    - ``k3_kl``: the same by k3, the token mean of ``exp(l_t) - l_t - 1`` (>= 0);
    - ``chi2_token``: ``mean(rho_t^2) - 1``; ``chi2_seq``: ``mean over rows of
      exp(2 clamp(sum_t l_t, +-20)) - 1``;
    - ``training_ppl`` / ``rollout_ppl``: the row mean of ``exp(-mean_t log p)`` for each policy;
      ``log_ppl_diff``: the row mean of ``mean_t(rollout) - mean_t(old)``.
    """
    log_ratio = old_log_probs - rollout_log_probs
    rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [N]
    mean_old = masked_mean(old_log_probs, response_mask, dim=-1)  # [N]
    mean_rollout = masked_mean(rollout_log_probs, response_mask, dim=-1)  # [N]
    return {
        "kl": masked_mean(-log_ratio, response_mask),
        "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1, response_mask),
        "chi2_token": (masked_mean(rho.square(), response_mask) - 1.0),
        "chi2_seq": ((2.0 * seq_log_ratio).exp().mean() - 1.0),
        "training_ppl": (-mean_old).exp().mean(),
        "rollout_ppl": (-mean_rollout).exp().mean(),
        "log_ppl_diff": (mean_rollout - mean_old).mean(),
    }
