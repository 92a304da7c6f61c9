"""GRPO (and its relatives: Dr. GRPO, DAPO's loss settings, RLOO) as an ``RLModule`` subclass."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rltrainer.algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, aggregate, kl_penalty, ppo_clip_loss
from rltrainer.algorithms.advantages import group_signal_metrics
from rltrainer.algorithms.aggregation import masked_sum_over
from rltrainer.algorithms.rollout_corr import (ROLLOUT_CORRECTIONS, check_rollout_correction, mismatch_metrics,
                                               rejects, share_of_batch)
from rltrainer.data.batch import RolloutBatch
from rltrainer.models import ModelSpec, build_causal_lm, frozen_copy, response_log_probs
from rltrainer.module import RLModule
from rltrainer.rewards import RewardManager, resolve_reward
from rltrainer.rollout.engine import SamplingParams

#: Non-tensor fields made by the rollout, not dataset columns; not passed to reward functions.
ROLLOUT_FIELDS = frozenset({"prompt_ids", "response_text", "uid", "finish_reason"})


class GRPO(RLModule):
    """Group Relative Policy Optimization (Shao et al. 2024) with the knobs of its successors.

    Args:
        model: hub id or local path, a transformers ``PretrainedConfig`` (random init), or a
            callable returning a causal LM.
        tokenizer: the transformers tokenizer of ``model``.
        reward_funcs: a callable ``fn(completions, **dataset_fields) -> list[float]``, a
            registered name (``"gsm8k"``, ``"math"``, ...), or a list of those.
        reward_weights: one weight per reward function (default 1.0 each).
        num_generations: group size ``G``: samples per prompt.
        max_new_tokens, temperature, top_p, top_k: rollout sampling (``top_k=0`` is off).
        lr, weight_decay, warmup_steps: AdamW with linear warm-up, then constant.
        clip_ratio_low, clip_ratio_high: the asymmetric PPO clip range ``[1-low, 1+high]``
            (DAPO's clip-higher: ``high=0.28``).
        clip_ratio_c: dual-clip cap for negative advantages (``None``: off).
        kl_coef: weight of the KL-to-reference loss (0: no reference model is built).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (``"low_var_kl"``).
        entropy_coef: weight of the entropy bonus.
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"`` or
            ``"seq-mean-token-sum-norm"`` (Dr. GRPO).
        norm_adv_by_std: divide advantages by the group std (``False``: Dr. GRPO).
        advantage_estimator: ``"grpo"``, ``"rloo"`` or ``"reinforce"``.
        update_epochs, mini_batch_size: passes over each batch, and rows per optimizer step.
        rollout_correction: correct for off-policy rollouts with an entry of
            :data:`~rltrainer.algorithms.rollout_corr.ROLLOUT_CORRECTIONS` (verl's rollout
            correction): ``"token_tis"``, ``"seq_tis"``, ``"token_rs"``, ``"seq_rs"``, ``"geo_rs"``,
            ``"token_mis"``, ``"seq_mis"``, ``"geo_rs_token_tis"``, ``"icepop"``; ``None``: off.
        rollout_correction_kwargs: that entry's parameters (``threshold``, the IS weight cap;
            ``low``, ``high``, the kept range of the ratio ``pi_old / pi_rollout``), overriding its
            defaults. Checked here: an unknown name, parameter or bad value raises.
        model_seed: seed for a randomly initialised ``model`` config.

    Off-policy rollouts (a Trainer that is ``off_policy``: an async pipeline, or an engine whose
    log-probs are not the trainer's; or a ``rollout_correction``) need ``old_log_probs``, the
    policy's log-probs before the update. With several optimizer steps per batch, or a correction
    that rejects tokens (it changes the loss's token count before the update), they are recomputed
    in a pass of their own (stage ``old_log_prob``) and corrected on the controller by
    ``advantage_step``. With one optimizer step per batch (``update_epochs=1``, no
    ``mini_batch_size``) and no rejection, the weights cannot move before every micro-batch's
    forward has run, so ``policy_step`` takes them from its own forward (detached, the same values)
    and applies the IS weights there: the same loss without the extra forward pass (verl computes
    the pass; the async pipelines are faster without it). Either way the step logs how far the
    rollout policy is (verl's names): ``rollout_corr/kl`` (k1, token mean of
    ``rollout_log_probs - old_log_probs``), ``rollout_corr/k3_kl``, ``rollout_corr/chi2_token``,
    ``rollout_corr/chi2_seq``, ``rollout_corr/{training,rollout}_ppl``, ``rollout_corr/log_ppl_diff``;
    with a correction, also ``rollout_corr/rollout_is_{mean,max,min,eff_sample_size}``,
    ``rollout_corr/rollout_is_ratio_fraction_{high,low}`` (share of weights truncated) and
    ``rollout_corr/rollout_rs_{masked_fraction,seq_masked_fraction}`` (share of tokens / rows
    rejected). The IS weights (``rollout_is_weights [N, T]``) multiply the per-token policy loss;
    rejected tokens leave ``response_mask``, so they count in no loss term and no denominator.
    Computed inside the update, the metrics are combined over micro-batches and ranks
    (:func:`~rltrainer.algorithms.rollout_corr.share_of_batch`).
    """

    def __init__(
        self,
        model: ModelSpec,
        tokenizer: Any,
        reward_funcs: Callable[..., list[float]] | str | Sequence[Callable[..., list[float]] | str],
        reward_weights: Sequence[float] | None = None,
        num_generations: int = 8,
        max_new_tokens: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float | None = 3.0,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        entropy_coef: float = 0.0,
        loss_agg_mode: str = "token-mean",
        norm_adv_by_std: bool = True,
        advantage_estimator: str = "grpo",
        update_epochs: int = 1,
        mini_batch_size: int | None = None,
        rollout_correction: str | None = None,
        rollout_correction_kwargs: dict[str, Any] | None = None,
        model_seed: int | None = 0,
    ) -> None:
        super().__init__()
        AGGREGATIONS.get(loss_agg_mode), KL_ESTIMATORS.get(kl_estimator)  # unknown names raise here
        self._advantage_fn = ADVANTAGES.get(advantage_estimator)
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        if not 0 <= clip_ratio_low < 1 or clip_ratio_high < 0:
            raise ValueError(f"Need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, "
                             f"{clip_ratio_high}")
        if clip_ratio_c is not None and clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 (the dual-clip cap) or None to disable it, got {clip_ratio_c}")
        if rollout_correction is None and rollout_correction_kwargs:
            raise ValueError(f"rollout_correction_kwargs={rollout_correction_kwargs!r} given without "
                             f"rollout_correction; name one of {', '.join(ROLLOUT_CORRECTIONS.names())}.")
        if rollout_correction is not None:  # an unknown name, parameter or value raises here
            check_rollout_correction(rollout_correction, dict(rollout_correction_kwargs or {}))
        if tokenizer is None or getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("GRPO needs a tokenizer with a pad_token_id (set tokenizer.pad_token).")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.rewards = RewardManager([resolve_reward(f) for f in funcs], reward_weights)
        self.model_spec = model
        self.model_seed = model_seed
        self.tokenizer = tokenizer
        self.sampling = SamplingParams(n=num_generations, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k)
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = clip_ratio_low, clip_ratio_high, clip_ratio_c
        self.kl_coef, self.kl_estimator, self.entropy_coef = kl_coef, kl_estimator, entropy_coef
        self.loss_agg_mode, self.norm_adv_by_std = loss_agg_mode, norm_adv_by_std
        self.advantage_estimator = advantage_estimator
        self.update_epochs, self.mini_batch_size = update_epochs, mini_batch_size
        self.rollout_correction = rollout_correction
        self.rollout_correction_kwargs = dict(rollout_correction_kwargs or {})
        self._correction_rejects = rollout_correction is not None and rejects(rollout_correction,
                                                                               self.rollout_correction_kwargs)

    # -- models ---------------------------------------------------------------------------------
    def configure_model(self) -> None:
        self.policy = build_causal_lm(self.model_spec, seed=self.model_seed)
        self.ref_policy = frozen_copy(self.policy) if self.kl_coef > 0 else None

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        warmup = max(self.warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": opt, "lr_scheduler": sched}

    # -- control flow ---------------------------------------------------------------------------
    def reward_step(self, batch: RolloutBatch) -> RolloutBatch:
        fields = {k: list(v) for k, v in batch.non_tensors.items() if k not in ROLLOUT_FIELDS}
        result = self.rewards(list(batch["response_text"]), fields)
        batch["scores"] = result.scores  # [N]
        for name, value in result.metrics().items():
            self.log(name, value)
        scores = result.scores
        self.log("critic/score/mean", scores.mean().item())
        self.log("critic/score/max", scores.max().item())
        self.log("critic/score/min", scores.min().item())
        return batch

    def compute_stages(self) -> list[str]:
        """``old_log_prob`` if the policy moves within a batch (``update_epochs > 1`` or
        ``mini_batch_size`` set), or the rollouts need correcting (:meth:`corrects_rollouts`) with a
        correction that rejects tokens; otherwise the old log-probs equal the current ones at the
        update's forward and ``policy_step`` uses those, detached. ``ref`` if ``kl_coef > 0``."""
        moves = self.update_epochs > 1 or self.mini_batch_size is not None
        needs_old = moves or (self.corrects_rollouts() and self._correction_rejects)
        return (["old_log_prob"] if needs_old else []) + (["ref"] if self.kl_coef > 0 else [])

    def corrects_rollouts(self) -> bool:
        """Whether rollouts can be off-policy here (the Trainer's ``off_policy``) or a
        ``rollout_correction`` is set: then the mismatch is logged and the correction applied."""
        off_policy = self._trainer is not None and getattr(self._trainer, "off_policy", False)
        return off_policy or self.rollout_correction is not None

    def correct_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """Log the rollout/trainer mismatch and apply ``rollout_correction`` (controller, called
        first by :meth:`advantage_step`; needs ``old_log_probs`` and ``rollout_log_probs``).

        Adds ``rollout_is_weights [N, T]`` if the correction has weights, and sets rejected tokens of
        ``response_mask [N, T]`` to 0, as verl does before computing advantages. Without
        ``old_log_probs`` (one optimizer step, no rejection: see :meth:`compute_stages`) it sets
        ``meta["correct_in_update"]`` and :meth:`policy_step` does the same with its own forward's.
        """
        if self.rollout_correction is not None and "rollout_log_probs" not in batch:
            raise KeyError(f"rollout_correction={self.rollout_correction!r} needs 'rollout_log_probs' [N, T] in the "
                           f"batch (the default rollout_step adds them); it has {batch.keys()}")
        if "rollout_log_probs" not in batch or not batch["response_mask"].any():
            return batch
        if "old_log_probs" not in batch:
            if self.corrects_rollouts():
                if self._correction_rejects:
                    raise KeyError(f"rollout_correction={self.rollout_correction!r} rejects tokens, so it needs "
                                   f"'old_log_probs' before the update (stage 'old_log_prob'); the batch has "
                                   f"{batch.keys()}")
                batch.meta["correct_in_update"] = True
            return batch
        old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
        metrics = mismatch_metrics(old, rollout, mask)
        if self.rollout_correction is not None:
            correction = ROLLOUT_CORRECTIONS.build(self.rollout_correction, old_log_probs=old,
                                                   rollout_log_probs=rollout, response_mask=mask,
                                                   **self.rollout_correction_kwargs)
            batch["response_mask"] = correction.response_mask  # [N, T], rejected tokens 0
            if correction.weights is not None:
                batch["rollout_is_weights"] = correction.weights  # [N, T], detached, 0 on padding
            metrics.update(correction.metrics)
        for name, value in metrics.items():
            self.log(f"rollout_corr/{name}", value)
        return batch

    def advantage_step(self, batch: RolloutBatch) -> RolloutBatch:
        batch = self.correct_rollouts(batch)
        kwargs = {"norm_by_std": self.norm_adv_by_std}
        accepted = inspect.signature(self._advantage_fn).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        advantages, returns = self._advantage_fn(batch["scores"], batch["response_mask"], batch["uid"], **kwargs)
        batch["advantages"] = advantages  # [N, T]
        batch["returns"] = returns  # [N, T]
        mask = batch["response_mask"].bool()
        self.log("critic/advantages/mean", advantages[mask].mean().item() if mask.any() else 0.0)
        signal = group_signal_metrics(batch["scores"], batch["uid"], batch["responses"], batch["response_mask"])
        for name, value in signal.items():  # a stalled run shows here: all groups zero-std
            self.log(name, value)
        return batch

    # -- compute flow ---------------------------------------------------------------------------
    def correct_micro_batch(self, old_log_probs: torch.Tensor, micro_batch: RolloutBatch
                            ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """:meth:`correct_rollouts` inside the update, on one micro-batch whose ``old_log_probs [n, T]``
        come from the update's own forward: the IS weights ``[n, T]`` (or ``None``) and the
        ``rollout_corr/*`` metrics as this micro-batch's share of the batch's."""
        mask, meta = micro_batch["response_mask"], micro_batch.meta
        rollout = micro_batch["rollout_log_probs"]
        metrics = mismatch_metrics(old_log_probs, rollout, mask)
        weights = None
        if self.rollout_correction is not None:
            correction = ROLLOUT_CORRECTIONS.build(self.rollout_correction, old_log_probs=old_log_probs,
                                                   rollout_log_probs=rollout, response_mask=mask,
                                                   **self.rollout_correction_kwargs)
            weights = correction.weights
            metrics.update(correction.metrics)
        shares = share_of_batch(metrics, mask, meta["global_tokens"], meta["global_rows"])
        return weights, {f"rollout_corr/{k}": v.detach() for k, v in shares.items()}

    def policy_step(self, micro_batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        mb, meta = micro_batch, micro_batch.meta
        temperature = meta.get("temperature") or 1.0
        counts = {"global_tokens": meta["global_tokens"], "global_rows": meta["global_rows"],
                  "max_response_length": self.sampling.max_new_tokens}
        mask = mb["response_mask"]
        log_probs, entropy = response_log_probs(self.policy, mb, temperature, with_entropy=True,
                                                entropy_grad=self.entropy_coef != 0)
        old_log_probs = mb["old_log_probs"] if "old_log_probs" in mb else log_probs.detach()
        is_weights = mb["rollout_is_weights"] if "rollout_is_weights" in mb else None  # off-policy correction
        corr_metrics = {}
        if meta.get("correct_in_update"):  # one optimizer step: old_log_probs are this forward's
            is_weights, corr_metrics = self.correct_micro_batch(old_log_probs, mb)
        pg_loss, metrics = ppo_clip_loss(
            log_probs, old_log_probs, mb["advantages"], mask, self.clip_ratio_low, self.clip_ratio_high,
            self.clip_ratio_c, self.loss_agg_mode, **counts, rollout_is_weights=is_weights,
        )
        metrics.update(corr_metrics)
        loss = pg_loss
        metrics["actor/pg_loss"] = pg_loss.detach()
        metrics["actor/entropy"] = masked_sum_over(entropy.detach(), mask, meta["global_tokens"])
        if self.entropy_coef != 0:
            loss = loss - self.entropy_coef * aggregate(entropy, mask, self.loss_agg_mode, **counts)
        if self.kl_coef > 0:
            kl_loss = aggregate(kl_penalty(log_probs, mb["ref_log_probs"], self.kl_estimator), mask,
                                self.loss_agg_mode, **counts)
            loss = loss + self.kl_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics
