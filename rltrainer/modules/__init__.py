"""Built-in algorithms: each an ``RLModule`` subclass."""

from rltrainer.modules.dapo import DAPO
from rltrainer.modules.grpo import GRPO
from rltrainer.modules.ppo import PPO

__all__ = ["DAPO", "GRPO", "PPO"]
