"""Rule-based rewards: plain callables ``fn(completions, **fields) -> list[float]``.

Each dataset field reaches the function as a keyword argument holding a list aligned with
``completions`` (e.g. ``ground_truth=[...]``); a reward function accepts ``**kwargs`` for fields
it does not use. Built-in rewards are registered by name in :data:`REWARDS`::

    fn = resolve_reward("gsm8k")          # same as passing gsm8k_reward itself
    manager = RewardManager([fn, my_format_reward], weights=[1.0, 0.1])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rltrainer.registry import Registry
from rltrainer.rewards.gsm8k import extract_gsm8k_answer, gsm8k_flexible, gsm8k_reward, gsm8k_strict
from rltrainer.rewards.manager import RewardManager, RewardResult, reward_name
from rltrainer.rewards.math import extract_boxed_answer, is_equiv, last_boxed_only_string, math_reward, strip_string

REWARDS: Registry[list[float]] = Registry("reward")
REWARDS.add("gsm8k", gsm8k_reward, description="GSM8K, strict: the number after the last '####' must be correct.")
REWARDS.add("gsm8k_flexible", gsm8k_flexible, description="GSM8K, flexible: the last number in the text.")
REWARDS.add("math", math_reward, description="MATH/MATH-500: the last \\boxed{} answer must be equivalent.")


def resolve_reward(fn_or_name: str | Callable[..., Any]) -> Callable[..., Any]:
    """The reward function registered as ``fn_or_name``, ``fn_or_name`` itself if callable, or the
    function a dotted path names (``"my_rewards.exact_match"``: how a config file names its own)."""
    if callable(fn_or_name):
        return fn_or_name
    if isinstance(fn_or_name, str) and "." in fn_or_name and fn_or_name not in REWARDS.names():
        return import_reward(fn_or_name)
    if isinstance(fn_or_name, str):
        return REWARDS.get(fn_or_name)
    raise TypeError(
        f"Expected a reward function or a registered reward name ({', '.join(REWARDS.names())}); "
        f"got {type(fn_or_name).__name__} {fn_or_name!r}."
    )


def import_reward(path: str) -> Callable[..., Any]:
    """The callable at dotted ``path`` (``package.module.function``); raises naming what failed."""
    import importlib

    module_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"Reward {path!r} is neither a registered name ({', '.join(REWARDS.names())}) nor an "
                         f"importable function: {exc}. Check the dotted path, or register the function.") from exc
    if not callable(fn):
        raise TypeError(f"Reward {path!r} names a {type(fn).__name__}, not a function")
    return fn


__all__ = [
    "REWARDS",
    "RewardManager",
    "RewardResult",
    "extract_boxed_answer",
    "extract_gsm8k_answer",
    "gsm8k_flexible",
    "gsm8k_reward",
    "gsm8k_strict",
    "is_equiv",
    "last_boxed_only_string",
    "math_reward",
    "resolve_reward",
    "reward_name",
    "strip_string",
]
