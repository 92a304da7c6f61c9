"""PPO: policy gradient with a critic (value model) trained alongside the policy, and GAE
advantages: :class:`~rltrainer.modules.PolicyGradient` with the parts
:class:`~rltrainer.algorithms.parts.Critic` and :class:`~rltrainer.algorithms.parts.CriticAdvantage`.
The same Trainer, Strategy and engine run it."""

from __future__ import annotations

from typing import Any, ClassVar

from rltrainer.algorithms.part import Part
from rltrainer.algorithms.parts import Critic, CriticAdvantage, build_value_model, response_values
from rltrainer.modules.policy_gradient import PolicyGradient

__all__ = ["PPO", "build_value_model", "response_values"]


class PPO(PolicyGradient):
    """Proximal Policy Optimization with a learned critic (Schulman et al. 2017; Ouyang et al. 2022).

    :class:`~rltrainer.modules.PolicyGradient` with a critic: takes every :class:`~rltrainer.GRPO`
    argument (``num_generations`` defaults to 1 here) and the settings of its parts, given whole
    (``parts=[Critic(...), CriticAdvantage(...)]``) or flat:

    - :class:`~rltrainer.algorithms.parts.Critic` (``critic``): ``critic_model`` (default: the
      policy's ``model`` with a value head), ``critic_lr=1e-5``, ``vf_coef=0.5``, ``cliprange_value=0.5``;
    - :class:`~rltrainer.algorithms.parts.CriticAdvantage` (``advantage``):
      ``advantage_estimator="gae"`` and the shorthands ``gamma=1.0``, ``lam=0.95``,
      ``kl_in_reward_coef=0.0`` for its parameters.
    """

    PARTS: ClassVar[dict[str, type[Part] | None]] = {**PolicyGradient.PARTS, "advantage": CriticAdvantage,
                                                      "critic": Critic}
    preset: ClassVar[dict[str, Any]] = {"num_generations": 1}
