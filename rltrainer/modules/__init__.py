"""Built-in algorithms: each an ``RLModule`` subclass."""

from rltrainer.modules.grpo import GRPO
from rltrainer.modules.ppo import PPO

__all__ = ["GRPO", "PPO"]
