"""Rollout engines: the interface, ``"hf"`` (transformers; runs anywhere), and the GPU engines
``"vllm"`` and ``"sglang"`` (optional extras, imported only when an engine is set up)."""

from rltrainer.rollout import hf as _hf  # noqa: F401  (registers "hf")
from rltrainer.rollout import sglang as _sglang  # noqa: F401  (registers "sglang"; imports sglang lazily)
from rltrainer.rollout import vllm as _vllm  # noqa: F401  (registers "vllm"; imports vllm lazily)
from rltrainer.rollout.engine import ENGINES, Generation, RolloutEngine, SamplingParams, build_engine

__all__ = ["ENGINES", "Generation", "RolloutEngine", "SamplingParams", "build_engine"]
