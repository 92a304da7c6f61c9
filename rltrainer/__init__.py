"""rltrainer: a thin, Lightning-style Trainer API for RL post-training of LLMs.

Seven concepts, for a newcomer:

1. ``RLModule``: the algorithm, as hooks (``rollout_step``, ``reward_step``, ``advantage_step``,
   ``policy_step``...). ``GRPO``, ``PPO``, ``DAPO`` and the other presets are a ``PolicyGradient``
   composed of parts (a loss, an advantage estimator, a rollout correction, optional critic,
   reference, teacher, reward model: :mod:`rltrainer.algorithms.parts`).
2. ``RolloutBatch``: the one batch type the hooks pass along (named fields with shapes).
3. ``Trainer``: drives ``fit`` on this (the controller) process and wires the rest.
4. ``Strategy``: the training compute (``"single"``, ``"fsdp2"``, ``"megatron"``): models,
   optimizers, forward/backward, checkpoints.
5. ``Rollout``: the ``RolloutEngine`` (generation: ``"hf"``, ``"vllm"``, ``"sglang"``), where it runs
   and how weights reach it; connected to the strategy, it gives a ``WeightSync``, the one owner of
   moving weights into the engine.
6. ``Pipeline``: when generation happens relative to training (``SyncPipeline``,
   ``OneStepOffPipeline``, ``AsyncPipeline``; or their names).
7. ``Callback``: everything around the step (checkpoints, progress, generation logging).
"""

from rltrainer.algorithms.distill import Teacher
from rltrainer.callbacks import Callback, LearningSignal, LogGenerations, ModelCheckpoint, ProgressBar
from rltrainer.data import RolloutBatch, prompt_dataloader
from rltrainer.loggers import Logger
from rltrainer.module import RLModule
from rltrainer.modules import DAPO, GRPO, PPO, PolicyGradient
from rltrainer.pipelines import AsyncPipeline, OneStepOffPipeline, SyncPipeline
from rltrainer.rewards.model import RewardModel
from rltrainer.rollout import ENGINES, HFEngine, RolloutEngine, SamplingParams, SGLangEngine, VLLMEngine
from rltrainer.rollout.rollout import Rollout
from rltrainer.strategies import STRATEGIES, FSDP2Strategy, MegatronStrategy, SingleDeviceStrategy, Strategy
from rltrainer.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "DAPO", "ENGINES", "GRPO", "PPO", "STRATEGIES", "AsyncPipeline", "Callback", "FSDP2Strategy", "HFEngine",
    "LearningSignal", "LogGenerations", "Logger", "MegatronStrategy", "ModelCheckpoint", "OneStepOffPipeline",
    "PolicyGradient", "ProgressBar", "RLModule", "RewardModel", "Rollout", "RolloutBatch", "RolloutEngine",
    "SGLangEngine", "SamplingParams",
    "SingleDeviceStrategy", "Strategy", "SyncPipeline", "Teacher", "Trainer", "VLLMEngine", "prompt_dataloader",
]
