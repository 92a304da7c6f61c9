"""Algorithm math as registry entries: advantages, policy losses, KL estimators, aggregation,
off-policy rollout corrections. (Every entry: the docs' "Registries" and "Algorithms" pages,
``.ci/docs/pages/registries.md`` and ``algorithms.md``.) The parts a
:class:`~rltrainer.modules.PolicyGradient` is composed of, which call these entries:
:mod:`rltrainer.algorithms.parts` (what a part is: :mod:`rltrainer.algorithms.part`)."""

from rltrainer.algorithms.advantages import (ADVANTAGES, AdvantageContext, check_advantage, gae_advantages,
                                             grpo_advantages, required_fields, rloo_advantages)
from rltrainer.algorithms.aggregation import AGGREGATIONS, aggregate
from rltrainer.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rltrainer.algorithms.losses import (POLICY_LOSSES, LossContext, check_policy_loss, clipped_value_loss,
                                         ppo_clip_loss)
from rltrainer.algorithms.rollout_corr import ROLLOUT_CORRECTIONS, Correction, mismatch_metrics

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "ROLLOUT_CORRECTIONS", "AdvantageContext",
    "Correction", "LossContext", "aggregate", "check_advantage", "check_policy_loss", "clipped_value_loss",
    "gae_advantages", "grpo_advantages", "kl_penalty", "mismatch_metrics", "ppo_clip_loss", "required_fields",
    "rloo_advantages",
]
