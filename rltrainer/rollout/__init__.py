"""Rollout engines: the interface, ``"hf"`` (transformers; runs anywhere), and the GPU engines
``"vllm"`` and ``"sglang"`` (optional extras, imported only when an engine is set up)."""

from rltrainer.rollout.engine import ENGINES, Generation, RolloutEngine, SamplingParams, build_engine
from rltrainer.rollout.hf import HFEngine  # registers "hf"
from rltrainer.rollout.sglang import SGLangEngine  # registers "sglang"; imports sglang lazily
from rltrainer.rollout.vllm import VLLMEngine  # registers "vllm"; imports vllm lazily

__all__ = ["ENGINES", "Generation", "HFEngine", "RolloutEngine", "SGLangEngine", "SamplingParams", "VLLMEngine",
           "build_engine"]
