"""Tinker's built-in losses (``forward_backward(data, loss_fn)``), as registry entries over per-token
log-probs.

Every entry has one signature::

    fn(target_logprobs [n, T], inputs: {name: [n, T]}, **config) -> loss [n, T]

``target_logprobs`` are the policy's log-probs of ``target_tokens``; ``inputs`` the datum's other
``loss_fn_inputs`` (``weights``, ``advantages``, ``logprobs``: the sampler's, ``sequence_ratio_mask``),
zero-padded past each row's length; ``config`` the call's ``loss_fn_config``. The loss of a call is the **sum** of the
per-token losses over the real tokens of every datum, never a mean: Tinker documents each loss as
``loss = -objective.sum()`` and its SDK's ``forward_backward_custom`` relies on ``cross_entropy``
being ``sum(-logprob * weight)`` (tinker 0.38 ``lib/public_interfaces/training_client.py:677-680``).

The formulas are Tinker's documentation's (https://tinker-docs.thinkingmachines.ai/tinker/losses,
``/losses/cispo``, ``/losses/dro``, ``/losses/gspo``, read 2026-12-05); the defaults not stated there
are marked. ``stable_reinforce`` (in the SDK's ``LossFnType``) is not here: it reads what the sampler
records per sequence (``record_stability_info``), which the docs do not define.
rltrainer's own policy losses (:mod:`rltrainer.algorithms.losses`) aggregate by token or row means
and clamp the log-ratio, so they are not reused here: a Tinker loss must be the plain sum.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrainer.registry import Registry

#: Tinker's loss names -> ``fn(target_logprobs, inputs, **config) -> [n, T]``.
TINKER_LOSSES: Registry = Registry("Tinker loss")

#: The ``loss_fn_inputs`` each loss reads (besides ``target_tokens``).
LOSS_INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
               "ppo": ("logprobs", "advantages"), "cispo": ("logprobs", "advantages"),
               "dro": ("logprobs", "advantages"), "gspo": ("logprobs", "advantages", "sequence_ratio_mask")}


@TINKER_LOSSES.register("cross_entropy")
def cross_entropy(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``-target_logprobs * weights`` (weights default to 1 where absent)."""
    weights = inputs.get("weights")
    return -target_logprobs * (weights if weights is not None else 1.0)


@TINKER_LOSSES.register("importance_sampling")
def importance_sampling(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """REINFORCE with importance sampling: ``-exp(target_logprobs - logprobs) * advantages``."""
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    return -ratio * inputs["advantages"]


@TINKER_LOSSES.register("ppo", clip_low_threshold=0.8, clip_high_threshold=1.2)
def ppo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], *, clip_low_threshold: float = 0.8,
        clip_high_threshold: float = 1.2) -> torch.Tensor:
    """``-min(r * A, clip(r, low, high) * A)`` with ``r = exp(target_logprobs - logprobs)``; the
    thresholds are ratios (Tinker's default clip range 0.2: 0.8 and 1.2)."""
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio * advantages, clipped * advantages)


@TINKER_LOSSES.register("cispo", clip_low_threshold=0.8, clip_high_threshold=1.2)
def cispo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], *, clip_low_threshold: float = 0.8,
          clip_high_threshold: float = 1.2) -> torch.Tensor:
    """``-sg[clip(r, low, high)] * target_logprobs * A`` (the thresholds' defaults are not in the
    docs; PPO's are used)."""
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    return -ratio.clamp(clip_low_threshold, clip_high_threshold).detach() * target_logprobs * inputs["advantages"]


@TINKER_LOSSES.register("dro", beta=0.05)
def dro(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], *, beta: float = 0.05) -> torch.Tensor:
    """``-(target_logprobs * A - beta / 2 * (target_logprobs - logprobs) ** 2)`` (the default
    ``beta`` is the docs' example value; the service's default is not documented)."""
    quadratic = (target_logprobs - inputs["logprobs"]) ** 2
    return -(target_logprobs * inputs["advantages"] - 0.5 * beta * quadratic)


@TINKER_LOSSES.register("gspo", clip_low_threshold=0.8, clip_high_threshold=1.2)
def gspo(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], *, clip_low_threshold: float = 0.8,
         clip_high_threshold: float = 1.2) -> torch.Tensor:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071), as Tinker implements it: the sequence's ratio
    ``s = exp(mean of target_logprobs - logprobs over the tokens sequence_ratio_mask marks)``, and
    each token's ``s_t = sg[s] * exp(lp_t - sg[lp_t])`` (``s``'s value, its own token's gradient) in
    ``-min(s_t * A_t, clip(s_t, low, high) * A_t)``. A row whose mask marks no token has ``s = 1``
    (Tinker's mean over none would be NaN). The thresholds are ratios; their defaults are **our
    choice**, PPO's (the docs give none; the paper clips far tighter, about ``1 - 3e-4`` and
    ``1 + 4e-4``)."""
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(target_logprobs.dtype)  # [n, T]
    log_ratio = (target_logprobs.detach() - inputs["logprobs"]) * in_ratio
    sequence = log_ratio.sum(1, keepdim=True) / in_ratio.sum(1, keepdim=True).clamp(min=1)  # [n, 1]
    ratio = torch.exp(sequence + target_logprobs - target_logprobs.detach())  # [n, T]: s's value, lp_t's gradient
    advantages = inputs["advantages"]
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def loss_settings(name: str, config: dict[str, Any] | None) -> dict[str, float]:
    """``config`` over the loss's defaults; an unknown name or key raises, listing the allowed ones."""
    if name not in TINKER_LOSSES:
        raise ValueError(f"Unknown loss_fn {name!r}. Built in: {', '.join(TINKER_LOSSES.names())}; or pass a "
                         "callable (data, logprobs_list) -> (loss, metrics) to forward_backward_custom.")
    return TINKER_LOSSES.resolve(name, {k: float(v) for k, v in (config or {}).items()})


def token_losses(name: str, target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
                 config: dict[str, float]) -> torch.Tensor:
    """The per-token loss ``[n, T]`` of the loss ``name``; a missing input raises, naming the loss's."""
    missing = [k for k in LOSS_INPUTS[name] if k not in inputs and k != "weights"]
    if missing:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_inputs {list(LOSS_INPUTS[name])} besides target_tokens; "
                         f"missing {missing} (got {sorted(inputs)})")
    return TINKER_LOSSES.get(name)(target_logprobs, inputs, **config)
