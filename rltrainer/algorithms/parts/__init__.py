"""The parts a policy-gradient module is composed of (:class:`~rltrainer.modules.PolicyGradient`):
each declares the forward passes it needs and the batch fields it reads and adds, and carries its
own settings. (What a part is: :mod:`rltrainer.algorithms.part`.)

- :class:`PolicyLoss` (``loss=``): the policy loss (``POLICY_LOSSES``), the entropy bonus;
- :class:`Advantage` (``advantage=``): the estimator (``ADVANTAGES``); :class:`CriticAdvantage`,
  PPO's, has GAE and its shorthands by default;
- :class:`RolloutCorrection` (``correction=``): the mismatch metrics, ``ROLLOUT_CORRECTIONS``;
- :class:`KLPenalty` (``kl=``): the KL-to-reference loss term;
- :class:`Critic` (``critic=``, PPO's by default): a value model, its pass and its loss;
- :class:`Teacher` (``teacher=``): on-policy distillation;
- :class:`RewardModelScores` (made from a ``RewardModel`` in ``reward_funcs``): its scores;
- :class:`Routing`: a mixture-of-experts policy's routing replay (R3) and load-balancing loss;
- :class:`OverlongPenalty`, :class:`TruncationMask`, :class:`DynamicSampling`: DAPO's
  (:mod:`rltrainer.algorithms.dapo`).

A part of your own: subclass :class:`~rltrainer.algorithms.part.Part` as a dataclass whose
fields are its settings, with a ``kind``, and add it to a module's ``PARTS`` (``class
Mine(PolicyGradient): PARTS = {**PolicyGradient.PARTS, "mine": MyPart}``): it is then given as
``Mine(..., parts=[MyPart(...)])``, or its settings as the module's flat keywords.
"""

from rltrainer.algorithms.dapo import DynamicSampling, OverlongPenalty, TruncationMask
from rltrainer.algorithms.distill import Teacher
from rltrainer.algorithms.parts.advantage import Advantage, CriticAdvantage
from rltrainer.algorithms.part import STAGE_FIELDS, BaseModels, Part, Sampler, Setup, Step, Update
from rltrainer.algorithms.parts.correction import RolloutCorrection
from rltrainer.algorithms.parts.critic import Critic, build_value_model, response_values
from rltrainer.algorithms.parts.loss import KLPenalty, PolicyLoss
from rltrainer.algorithms.parts.reward_model import RewardModelScores, log_scores
from rltrainer.algorithms.parts.routing import Routing

__all__ = ["STAGE_FIELDS", "Advantage", "BaseModels", "Critic", "CriticAdvantage", "DynamicSampling", "KLPenalty",
           "OverlongPenalty", "Part", "PolicyLoss", "RewardModelScores", "RolloutCorrection", "Routing", "Sampler",
           "Setup", "Step", "Teacher", "TruncationMask", "Update", "build_value_model", "log_scores", "response_values"]
