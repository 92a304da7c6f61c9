"""The RLModule behind the primitives: a policy, AdamW, and Tinker's losses as ``policy_step``.

A Strategy runs it like any module (:meth:`~rltrainer.strategies.strategy.Strategy.setup`,
``compute``, ``train_step``), so the primitives run on every strategy that runs a module. Its
batches are datums laid out by :func:`rltrainer.own_loop.data.datums_batch`.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.lora import apply_lora, check_lora_config
from rltrainer.models import ModelSpec, build_causal_lm, response_log_probs
from rltrainer.module import RLModule
from rltrainer.optim import adamw
from rltrainer.own_loop.data import batch_inputs
from rltrainer.own_loop.losses import token_losses

#: The ``compute_step`` stage of :meth:`PrimitivesModule.compute_step`.
LOGPROBS_STAGE = "tinker_logprobs"


class PrimitivesModule(RLModule):
    """A causal LM (``model``: a hub id, path, ``PretrainedConfig`` or callable, as
    :func:`~rltrainer.models.build_causal_lm` takes) trained by Tinker-style calls; ``lora``: a
    ``peft.LoraConfig`` (only the adapter trains). The optimizer is AdamW with Tinker's
    ``AdamParams`` defaults; each ``optim_step`` sets its hyperparameters first: they travel in the
    batch's ``meta["adam"]`` (and the clip in ``meta["grad_clip_norm"]``, 0: none), :meth:`policy_step`
    keeps them, and the hooks every strategy calls before it clips and steps set them:
    :meth:`on_before_optimizer_step` on the optimizer the rank steps (megatron-core's on
    ``megatron``), :meth:`gradient_clip_norm` as the norm to clip to."""

    def __init__(self, model: ModelSpec, lora: Any = None, seed: int | None = 0) -> None:
        super().__init__()
        if lora is not None:
            check_lora_config(lora)
        self.model_spec, self.lora, self.model_seed = model, lora, seed
        self._step_meta: dict[str, Any] = {}  # this rank's current step's meta (AdamParams, clip)

    def configure_model(self) -> None:
        self.policy = build_causal_lm(self.model_spec, seed=self.model_seed)
        if self.lora is not None:
            self.policy = apply_lora(self.policy, self.lora, seed=self.model_seed or 0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return adamw(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)  # fused where torch has it

    def compute_step(self, micro_batch: RolloutBatch, stage: str) -> dict[str, torch.Tensor]:
        """``logprobs [n, T]``: the log-probs of each row's ``target_tokens`` (0 past its length)."""
        if stage != LOGPROBS_STAGE:
            return super().compute_step(micro_batch, stage)
        return {"logprobs": response_log_probs(self.policy, micro_batch)[0] * micro_batch["response_mask"]}

    def policy_step(self, micro_batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The sum of each row's loss (its call's ``loss_fn`` and ``loss_fn_config``) over its tokens;
        metric ``loss:sum`` (a share that sums over micro-batches)."""
        self._step_meta = {k: micro_batch.meta[k] for k in ("adam", "grad_clip_norm") if k in micro_batch.meta}
        log_probs, _ = response_log_probs(self.policy, micro_batch)  # [n, T]
        loss = summed_loss(log_probs, micro_batch)
        return loss, {"loss:sum": loss.detach()}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """This step's AdamParams (``lr``, ``betas``, ``eps``, ``weight_decay``) on every param group
        of the optimizer the rank steps."""
        adam = self._step_meta.get("adam")
        for group in optimizer.param_groups if adam is not None else []:
            group.update(adam)

    def gradient_clip_norm(self, gradient_clip_val: float | None) -> float | None:
        """This step's ``AdamParams.grad_clip_norm`` (0: no clipping, as in Tinker); the strategy's
        setting for a step that carries none."""
        if "grad_clip_norm" not in self._step_meta:
            return gradient_clip_val
        return self._step_meta["grad_clip_norm"] or None


def summed_loss(log_probs: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """``sum`` over rows and real tokens of the per-token losses, each row under its own loss."""
    mask = batch["response_mask"].to(log_probs.dtype)
    inputs = batch_inputs(batch)
    names = list(batch["loss_fn"])
    configs = list(batch["loss_fn_config"])
    total = log_probs.new_zeros(())
    start = 0
    while start < len(names):  # runs of rows from one call share a loss and a config
        end = start
        while end < len(names) and names[end] == names[start] and configs[end] == configs[start]:
            end += 1
        rows = slice(start, end)
        per_token = token_losses(names[start], log_probs[rows], {k: v[rows] for k, v in inputs.items()},
                                 configs[start])
        total = total + (per_token * mask[rows]).sum()
        start = end
    return total
