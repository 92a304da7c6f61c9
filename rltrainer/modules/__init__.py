"""Built-in algorithms: each an ``RLModule`` subclass."""

from rltrainer.modules.grpo import GRPO

__all__ = ["GRPO"]
