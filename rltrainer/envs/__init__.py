"""Multi-turn rollouts, tools and environments, with the engine's exact tokens across turns.

``GRPO(model, tokenizer, environment=MultiTurn(MyEnv, max_turns=4))``: the default ``rollout_step``
runs ``G`` episodes per prompt row (:class:`MultiTurn`), and the score is the environment's reward
(:func:`env_reward`, the default ``reward_funcs`` then).
"""

from __future__ import annotations

from typing import Any

from rltrainer.envs.adapters import GymText, GymTextEnvironment, ReasoningGym, ReasoningGymEnvironment
from rltrainer.envs.chat import ChatFormat
from rltrainer.envs.environment import Environment, StepResult, tool_methods, tool_schemas
from rltrainer.envs.rollout import MultiTurn
from rltrainer.envs.tools import TOOL_PARSERS, HermesToolParser, ToolCall


def env_reward(completions: list[str], env_reward: list[float], **kwargs: Any) -> list[float]:
    """The reward function of multi-turn rows: each episode's summed environment reward
    (the ``env_reward`` field :class:`MultiTurn` writes)."""
    return [float(r) for r in env_reward]


def as_multi_turn(environment: Any) -> MultiTurn | None:
    """``environment`` as a :class:`MultiTurn` (a class or factory gets its defaults); ``None`` stays."""
    if environment is None or isinstance(environment, MultiTurn):
        return environment
    return MultiTurn(environment)


__all__ = ["TOOL_PARSERS", "ChatFormat", "Environment", "GymText", "GymTextEnvironment", "HermesToolParser",
           "MultiTurn", "ReasoningGym", "ReasoningGymEnvironment", "StepResult", "ToolCall", "as_multi_turn",
           "env_reward", "tool_methods", "tool_schemas"]
