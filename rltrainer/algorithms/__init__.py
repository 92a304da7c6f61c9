"""Algorithm math as registry entries: advantages, policy losses, KL estimators, aggregation."""

from rltrainer.algorithms.advantages import ADVANTAGES, gae_advantages, grpo_advantages, rloo_advantages
from rltrainer.algorithms.aggregation import AGGREGATIONS, aggregate
from rltrainer.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rltrainer.algorithms.losses import POLICY_LOSSES, clipped_value_loss, ppo_clip_loss

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "aggregate", "clipped_value_loss",
    "gae_advantages", "grpo_advantages", "kl_penalty", "ppo_clip_loss", "rloo_advantages",
]
