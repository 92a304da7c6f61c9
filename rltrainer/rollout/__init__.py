"""Rollout engines: the interface, and ``"hf"`` (transformers; runs anywhere)."""

from rltrainer.rollout import hf as _hf  # noqa: F401  (registers "hf")
from rltrainer.rollout.engine import ENGINES, Generation, RolloutEngine, SamplingParams, build_engine

__all__ = ["ENGINES", "Generation", "RolloutEngine", "SamplingParams", "build_engine"]
