"""rltrainer: a thin, Lightning-style Trainer API for RL post-training of LLMs."""

from rltrainer.algorithms.distill import Teacher
from rltrainer.callbacks import Callback, LearningSignal, LogGenerations, ModelCheckpoint, ProgressBar
from rltrainer.data import RolloutBatch, prompt_dataloader
from rltrainer.loggers import Logger
from rltrainer.module import RLModule
from rltrainer.modules import DAPO, GRPO, PPO
from rltrainer.pipelines import AsyncPipeline, OneStepOffPipeline, SyncPipeline
from rltrainer.rewards.model import RewardModel
from rltrainer.rollout import ENGINES, HFEngine, RolloutEngine, SamplingParams, SGLangEngine, VLLMEngine
from rltrainer.strategies import STRATEGIES, FSDP2Strategy, MegatronStrategy, SingleDeviceStrategy, Strategy
from rltrainer.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "DAPO", "ENGINES", "GRPO", "PPO", "STRATEGIES", "AsyncPipeline", "Callback", "FSDP2Strategy", "HFEngine",
    "LearningSignal", "LogGenerations", "Logger", "MegatronStrategy", "ModelCheckpoint", "OneStepOffPipeline",
    "ProgressBar", "RLModule", "RewardModel", "RolloutBatch", "RolloutEngine", "SGLangEngine", "SamplingParams",
    "SingleDeviceStrategy", "Strategy", "SyncPipeline", "Teacher", "Trainer", "VLLMEngine", "prompt_dataloader",
]
