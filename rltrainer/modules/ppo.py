"""PPO: GRPO's policy loss plus a critic (value model) trained alongside the policy, and GAE
advantages. The same Trainer, Strategy and engine run it; the shared pieces (the registries'
estimator and loss, :func:`~rltrainer.modules.grpo.required_stages`) are the same calls, with a
critic's ``values`` among the needs."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from rltrainer.algorithms import ADVANTAGES, clipped_value_loss
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import ModelSpec, init_from_config
from rltrainer.modules.grpo import GRPO
from rltrainer.registry import entry_params
from rltrainer.rewards.model import RewardSpec
from rltrainer.optim import adamw


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
        from rltrainer.packing import packed_rows_for

        packed = packed_rows_for(critic, batch)
        out = critic(**packed.inputs).logits[0, :, 0]  # [L]
        return packed.unpack(out[packed.predictors].float())
    from rltrainer.models import pad_columns, trim_padding_columns

    T = batch["responses"].shape[1]
    inputs, kept = trim_padding_columns({k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}, T)
    out = critic(**inputs).logits[..., 0]  # [n, P'+kept]: the columns padding in every row left out
    return pad_columns(out[:, -kept - 1 : -1].float(), T)


class PPO(GRPO):
    """Proximal Policy Optimization with a learned critic (Schulman et al. 2017; Ouyang et al. 2022).

    Takes every :class:`GRPO` argument (``num_generations`` defaults to 1 here) plus:

    Args:
        critic_model: the critic's spec (default: the policy's ``model``, with a value head).
        critic_lr: the critic's learning rate.
        vf_coef: weight of the value loss in the combined loss.
        cliprange_value: the value clip range around the old values.
        gamma, lam: GAE's discount and trace decay (shorthands for the estimator's parameters).
        kl_in_reward_coef: subtract ``coef * KL(policy || ref)`` (k1, per token) from the token
            rewards, InstructGPT style; needs a reference model, so it builds one (a shorthand for
            the estimator's ``kl_in_reward_coef``).
        advantage_estimator: ``"gae"`` by default; any entry of ``ADVANTAGES`` (the critic is
            trained either way). ``gamma``, ``lam`` and ``kl_in_reward_coef`` map onto its
            parameters of those names, as GRPO's ``clip_ratio_*`` onto the loss's.
    """

    uses_critic = True

    def __init__(self, model: ModelSpec, tokenizer: Any,
                 reward_funcs: RewardSpec | Sequence[RewardSpec] | None,
                 critic_model: ModelSpec | None = None, critic_lr: float = 1e-5, vf_coef: float = 0.5,
                 cliprange_value: float = 0.5, gamma: float = 1.0, lam: float = 0.95,
                 kl_in_reward_coef: float = 0.0, num_generations: int = 1, advantage_estimator: str = "gae",
                 advantage_kwargs: dict[str, Any] | None = None, **grpo_kwargs: Any) -> None:
        shorthands = {"gamma": ("gamma", 1.0), "lam": ("lam", 0.95), "kl_in_reward_coef": ("kl_in_reward_coef", 0.0)}
        advantage_kwargs = entry_params("advantage estimator", advantage_estimator,
                                        ADVANTAGES.defaults(advantage_estimator), advantage_kwargs,
                                        {"gamma": gamma, "lam": lam, "kl_in_reward_coef": kl_in_reward_coef},
                                        shorthands)
        super().__init__(model, tokenizer, reward_funcs, num_generations=num_generations,
                         advantage_estimator=advantage_estimator, advantage_kwargs=advantage_kwargs, **grpo_kwargs)
        self.critic_spec = critic_model if critic_model is not None else model
        self.critic_lr, self.vf_coef, self.cliprange_value = critic_lr, vf_coef, cliprange_value
        self.gamma, self.lam, self.kl_in_reward_coef = gamma, lam, kl_in_reward_coef

    def configure_model(self) -> None:
        super().configure_model()
        self.critic = build_value_model(self.critic_spec, seed=self.model_seed)

    def configure_optimizers(self) -> list[dict[str, Any]]:
        critic_opt = adamw(self.critic.parameters(), lr=self.critic_lr, weight_decay=self.weight_decay)
        return [super().configure_optimizers(), {"optimizer": critic_opt}]

    def compute_step(self, micro_batch: RolloutBatch, stage: str) -> dict[str, torch.Tensor]:
        if stage == "values":
            return {"values": response_values(self.critic, micro_batch)}
        return super().compute_step(micro_batch, stage)

    def advantage_step(self, batch: RolloutBatch) -> RolloutBatch:
        batch = super().advantage_step(batch)  # the estimator (GAE) reads the critic's values from the batch
        mask = batch["response_mask"]  # [N, T]
        self.log("critic/values/mean", (batch["values"] * mask).sum().item() / max(mask.sum().item(), 1))
        return batch

    def policy_step(self, micro_batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        actor_loss, metrics = super().policy_step(micro_batch)
        meta = micro_batch.meta
        vf_loss, vf_metrics = clipped_value_loss(
            response_values(self.critic, micro_batch), micro_batch["values"], micro_batch["returns"],
            micro_batch["response_mask"], self.cliprange_value, self.loss_agg_mode, meta["global_tokens"],
            meta["global_rows"], self.sampling.max_new_tokens)
        metrics.update(vf_metrics)
        metrics["critic/vf_loss"] = vf_loss.detach()
        return actor_loss + self.vf_coef * vf_loss, metrics
