"""The critic part: a value model trained alongside the policy (PPO), its ``values`` pass and its
clipped value loss."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.losses import clipped_value_loss
from rltrainer.algorithms.part import BaseModels, Part, Step, Update
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import ModelSpec, init_from_config, pad_columns, trim_padding_columns
from rltrainer.optim import adamw
from rltrainer.packing import packed_rows_for
from rltrainer.values import check_float


def build_value_model(spec: ModelSpec, seed: int | None = None) -> torch.nn.Module:
    """A transformers token-classification model with one output (a value per position) from a
    hub id or path (backbone weights loaded, head random), a config, or a callable. Dropout before
    the head is off (as in verl): the values the update clips around are computed in eval mode.

    Inside :func:`~rltrainer.models.deferred_init` a config gives a model on the meta device with
    its random init attached (as :func:`~rltrainer.models.build_causal_lm` does); a hub id or path
    is built in full (its head is not in the checkpoint)."""
    from transformers import AutoModelForTokenClassification, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        if seed is not None:
            torch.manual_seed(seed)
        config = copy.deepcopy(spec)
        config.num_labels, config.classifier_dropout = 1, 0.0
        return init_from_config(config, auto_class=AutoModelForTokenClassification)
    if isinstance(spec, str):  # transformers 5 passes unknown from_pretrained kwargs to __init__: set them on the config
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec)
        config.num_labels, config.classifier_dropout = 1, 0.0
        return AutoModelForTokenClassification.from_pretrained(spec, config=config)
    return spec()


def response_values(critic: torch.nn.Module, batch: RolloutBatch, padding_free: bool | None = None) -> torch.Tensor:
    """``V [n, T]``: the critic's value at each position that predicts a response token (0 past
    the micro-batch's longest response: its all-padding columns are left out, as in
    :func:`~rltrainer.models.response_log_probs`). With
    ``padding_free`` (default: ``batch.padding_free``, set by the Strategy) the rows run
    packed into one sequence (:mod:`rltrainer.packing`), and response padding gets 0."""
    if padding_free is None:
        padding_free = getattr(batch, "padding_free", False)  # a plain dict of tensors runs padded
    if padding_free:
        packed = packed_rows_for(critic, batch)
        out = critic(**packed.inputs).logits[0, :, 0]  # [L]
        return packed.unpack(out[packed.predictors].float())
    T = batch["responses"].shape[1]
    inputs, kept = trim_padding_columns({k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}, T)
    out = critic(**inputs).logits[..., 0]  # [n, P'+kept]: the columns padding in every row left out
    return pad_columns(out[:, -kept - 1 : -1].float(), T)


@dataclass
class Critic(Part):
    """A value model trained alongside the policy: the ``values`` pass before the advantages (GAE
    reads them), and ``vf_coef`` times the clipped value loss in the update.

    Args:
        critic_model: the critic's spec (default: the policy's ``model``, with a value head).
        critic_lr: the critic's learning rate (AdamW, the policy's ``weight_decay``).
        vf_coef: weight of the value loss in the combined loss.
        cliprange_value: the value clip range around the old values.
    """

    critic_model: ModelSpec | None = None
    critic_lr: float = 1e-5
    vf_coef: float = 0.5
    cliprange_value: float = 0.5

    kind: ClassVar[str] = "critic"
    reads: ClassVar[tuple[str, ...]] = ("values", "returns", "response_mask")
    adds: ClassVar[tuple[str, ...]] = ("values",)

    def __post_init__(self) -> None:
        self.critic_lr = check_float("critic_lr", self.critic_lr, above=0, meaning="the critic's learning rate")
        self.vf_coef = check_float("vf_coef", self.vf_coef, at_least=0, meaning="weight of the value loss")
        self.cliprange_value = check_float("cliprange_value", self.cliprange_value, above=0,
                                           meaning="the value clip range around the old values")

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return ("values",)

    def build_models(self, base: BaseModels) -> dict[str, torch.nn.Module]:
        spec = self.critic_model if self.critic_model is not None else base.model_spec
        return {"critic": build_value_model(spec, seed=base.model_seed)}

    def optimizers(self, models: Mapping[str, torch.nn.Module], weight_decay: float) -> list[dict[str, Any]]:
        return [{"optimizer": adamw(models["critic"].parameters(), lr=self.critic_lr, weight_decay=weight_decay)}]

    def compute(self, models: Mapping[str, torch.nn.Module], micro_batch: RolloutBatch, stage: str
                ) -> dict[str, torch.Tensor] | None:
        return {"values": response_values(models["critic"], micro_batch)} if stage == "values" else None

    def after_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        mask = batch["response_mask"]  # [N, T]
        step.log("critic/values/mean", (batch["values"] * mask).sum().item() / max(mask.sum().item(), 1))
        return batch

    def update(self, u: Update) -> None:
        mb, counts = u.micro_batch, u.counts
        vf_loss, vf_metrics = clipped_value_loss(
            response_values(u.models["critic"], mb), mb["values"], mb["returns"], mb["response_mask"],
            self.cliprange_value, u.loss_agg_mode, counts["global_tokens"], counts["global_rows"],
            counts["max_response_length"])
        u.metrics.update(vf_metrics)
        u.metrics["critic/vf_loss"] = vf_loss.detach()
        u.add(self.vf_coef * vf_loss)
