"""PPO: policy gradient with a critic (value model) trained alongside the policy, and GAE
advantages: :class:`~rltrainer.modules.PolicyGradient` with the parts
:class:`~rltrainer.algorithms.parts.Critic` and :class:`~rltrainer.algorithms.parts.CriticAdvantage`.
The same Trainer, Strategy and engine run it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from rltrainer.algorithms.part import Part
from rltrainer.algorithms.parts import Critic, CriticAdvantage, build_value_model, response_values
from rltrainer.models import ModelSpec
from rltrainer.modules.policy_gradient import SIGNATURE_ORDER, PolicyGradient
from rltrainer.rewards.model import RewardSpec

__all__ = ["PPO", "build_value_model", "response_values"]


class PPO(PolicyGradient):
    """Proximal Policy Optimization with a learned critic (Schulman et al. 2017; Ouyang et al. 2022).

    :class:`~rltrainer.modules.PolicyGradient` with a critic: takes every :class:`~rltrainer.GRPO`
    argument (``num_generations`` defaults to 1 here) plus the settings of its parts:

    - :class:`~rltrainer.algorithms.parts.Critic`: ``critic_model`` (default: the policy's
      ``model`` with a value head), ``critic_lr=1e-5``, ``vf_coef=0.5``, ``cliprange_value=0.5``;
    - :class:`~rltrainer.algorithms.parts.CriticAdvantage`: ``advantage_estimator="gae"`` and the
      shorthands ``gamma=1.0``, ``lam=0.95``, ``kl_in_reward_coef=0.0`` for its parameters.
    """

    PARTS: ClassVar[dict[str, type[Part] | None]] = {**PolicyGradient.PARTS, "advantage": CriticAdvantage,
                                                      "critic": Critic}
    signature_order = ("model", "tokenizer", "reward_funcs", "critic_model", "critic_lr", "vf_coef", "cliprange_value",
                       "gamma", "lam", "kl_in_reward_coef", "num_generations", "advantage_estimator",
                       "advantage_kwargs", *SIGNATURE_ORDER)

    def __init__(self, model: ModelSpec, tokenizer: Any, reward_funcs: Sequence[RewardSpec] | RewardSpec | None, *,
                 num_generations: int = 1, **settings: Any) -> None:
        super().__init__(model, tokenizer, reward_funcs, num_generations=num_generations, **settings)
