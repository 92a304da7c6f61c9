"""KL estimators between the policy and the reference model, per token.

With ``r = p_ref / p_policy`` evaluated at tokens sampled from the policy (Schulman's note
"Approximating KL Divergence"):

- ``k1``  (alias ``kl``):         ``log p - log p_ref``          unbiased, high variance, can be < 0
- ``k2``  (alias ``mse``):        ``0.5 * (log p - log p_ref)^2`` biased, low variance, >= 0
- ``k3``  (alias ``low_var_kl``): ``r - log r - 1``              unbiased, low variance, >= 0;
  clamped to ``[-10, 10]`` like verl's ``low_var_kl``
"""

from __future__ import annotations

import torch

from rltrainer.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``log p - log p_ref``."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("k2")
def k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (log p - log p_ref)^2``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3")
def k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``exp(log p_ref - log p) - (log p_ref - log p) - 1``, clamped to [-10, 10]."""
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


KL_ESTIMATORS.add("kl", k1, description="alias of k1")
KL_ESTIMATORS.add("mse", k2, description="alias of k2")
KL_ESTIMATORS.add("low_var_kl", k3, description="alias of k3")


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate ``[n, T]`` with the named estimator."""
    return KL_ESTIMATORS.get(estimator)(log_probs, ref_log_probs)
