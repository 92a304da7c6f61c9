"""The reward-model part: a sequence-classification model scored on the training ranks (stage
``reward_model``), whose weighted scores join the rule rewards' before the advantages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from rltrainer.algorithms.part import BaseModels, Log, Part, Step
from rltrainer.data.batch import RolloutBatch
from rltrainer.rewards.model import RewardModel, build_reward_model, sequence_scores
from rltrainer.values import check_float


def log_scores(scores: torch.Tensor, log: Log) -> None:
    """``critic/score/{mean,max,min}`` of the scores the estimator sees (``[N]``)."""
    for stat in ("mean", "max", "min"):
        log(f"critic/score/{stat}", getattr(scores, stat)().item())


@dataclass
class RewardModelScores(Part):
    """A :class:`~rltrainer.rewards.model.RewardModel` given in ``reward_funcs``, with its weight.

    Stage ``reward_model`` adds ``rm_scores [N]``; first in ``advantage_step``, ``scores += weight *
    rm_scores`` (logged: ``reward_model/score/mean``, ``reward/<name>/mean``, ``critic/score/*``)."""

    spec: RewardModel
    weight: float = 1.0

    kind: ClassVar[str] = "reward_model"
    reads: ClassVar[tuple[str, ...]] = ("rm_scores", "scores")
    adds: ClassVar[tuple[str, ...]] = ("rm_scores",)

    def __post_init__(self) -> None:
        self.weight = check_float("weight", self.weight, owner="RewardModelScores", meaning="the reward model's weight")

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return ("reward_model",)

    def build_models(self, base: BaseModels) -> dict[str, torch.nn.Module]:
        return {"reward_model": build_reward_model(self.spec.model, base.tokenizer.pad_token_id, seed=self.spec.seed)}

    def compute(self, models: Mapping[str, torch.nn.Module], micro_batch: RolloutBatch, stage: str
                ) -> dict[str, torch.Tensor] | None:
        return {"rm_scores": sequence_scores(models["reward_model"], micro_batch)} if stage == "reward_model" else None

    def before_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        if "rm_scores" not in batch:
            raise KeyError(f"A RewardModel is set, so advantage_step needs 'rm_scores' [N] from the compute stage "
                           f"'reward_model' (compute_stages adds it); the batch has {batch.keys()}")
        rm_scores = batch["rm_scores"].float()  # [N]
        batch["scores"] = batch["scores"] + self.weight * rm_scores  # [N]
        step.log("reward_model/score/mean", rm_scores.mean().item())
        step.log(f"reward/{self.spec.name}/mean", rm_scores.mean().item())
        log_scores(batch["scores"], step.log)
        return batch
