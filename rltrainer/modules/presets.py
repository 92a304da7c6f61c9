"""Presets that are settings of :class:`~rltrainer.modules.PolicyGradient`'s parts: the same
module, other defaults (every setting can still be given). A preset of your own is the same few
lines: a subclass with ``preset = {...}`` (the parts' settings, and ``num_generations``), or other
``PARTS``."""

from __future__ import annotations

from rltrainer.modules.policy_gradient import PolicyGradient


class DrGRPO(PolicyGradient):
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): GRPO's advantages without the division by the
    group std (``norm_adv_by_std=False``), and the loss summed over tokens and divided by a constant,
    the generation budget (``loss_agg_mode="seq-mean-token-sum-norm"``)."""

    preset = {"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"}


class GSPO(PolicyGradient):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): the clip on the sequence-level ratio
    (``policy_loss="gspo"``, clip range 3e-4 / 4e-4), averaged over sequences
    (``loss_agg_mode="seq-mean-token-mean"``)."""

    preset = {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}


class CISPO(PolicyGradient):
    """CISPO (MiniMax 2025, arXiv:2506.13585): REINFORCE weighted by the clipped, stop-gradient IS
    ratio (``policy_loss="cispo"``, ``clip_ratio_high`` of the IS weight 4.0)."""

    preset = {"policy_loss": "cispo"}


class RLOO(PolicyGradient):
    """RLOO (Ahmadian et al. 2024): each sample's baseline is the mean of the others in its group
    (``advantage_estimator="rloo"``)."""

    preset = {"advantage_estimator": "rloo"}


class ReinforcePlusPlus(PolicyGradient):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): return-to-go of the token rewards, whitened over the
    batch (``advantage_estimator="reinforce_plus_plus"``; a KL in the reward with
    ``advantage_kwargs={"kl_in_reward_coef": ...}``)."""

    preset = {"advantage_estimator": "reinforce_plus_plus"}


__all__ = ["CISPO", "GSPO", "RLOO", "DrGRPO", "ReinforcePlusPlus"]
