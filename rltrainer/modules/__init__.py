"""Built-in algorithms: :class:`PolicyGradient`, composed of parts (:mod:`rltrainer.algorithms.parts`),
and its presets, each a choice of parts and defaults:

- :class:`GRPO`: the default parts (``ppo_clip`` loss, ``grpo`` advantages);
- :class:`DrGRPO`, :class:`GSPO`, :class:`CISPO`, :class:`RLOO`, :class:`ReinforcePlusPlus`:
  GRPO with other settings (:mod:`rltrainer.modules.presets`);
- :class:`DAPO`: clip-higher defaults, plus three parts: dynamic sampling, overlong shaping and
  truncated responses masked;
- :class:`PPO`: policy gradient plus a critic, GAE advantages.
"""

from rltrainer.modules.dapo import DAPO
from rltrainer.modules.grpo import GRPO
from rltrainer.modules.policy_gradient import PolicyGradient
from rltrainer.modules.ppo import PPO
from rltrainer.modules.presets import CISPO, GSPO, RLOO, DrGRPO, ReinforcePlusPlus

__all__ = ["CISPO", "DAPO", "GRPO", "GSPO", "PPO", "RLOO", "DrGRPO", "PolicyGradient", "ReinforcePlusPlus"]
