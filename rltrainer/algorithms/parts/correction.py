"""The rollout-correction part: log how far the rollout policy is from the trainer's, and correct
for it with an entry of :data:`~rltrainer.algorithms.rollout_corr.ROLLOUT_CORRECTIONS`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.part import Part, Step, Update
from rltrainer.algorithms.rollout_corr import (ROLLOUT_CORRECTIONS, check_rollout_correction, mismatch_metrics,
                                               rejects, share_of_batch)
from rltrainer.data.batch import RolloutBatch


@dataclass
class RolloutCorrection(Part):
    """Off-policy rollouts: the mismatch metrics, and verl's rollout correction if one is named.

    Args:
        rollout_correction: correct for off-policy rollouts with an entry of
            :data:`~rltrainer.algorithms.rollout_corr.ROLLOUT_CORRECTIONS` (verl's rollout
            correction): ``"token_tis"``, ``"seq_tis"``, ``"token_rs"``, ``"seq_rs"``, ``"geo_rs"``,
            ``"token_mis"``, ``"seq_mis"``, ``"geo_rs_token_tis"``, ``"icepop"``; ``None``: off.
            ``fit`` refuses one with an engine whose log-probs are not the full softmax at the
            temperature for this sampling (vLLM with ``top_p < 1`` or ``top_k > 0``).
        rollout_correction_kwargs: that entry's parameters (``threshold``, the IS weight cap;
            ``low``, ``high``, the kept range of the ratio ``pi_old / pi_rollout``), overriding its
            defaults. Checked here: an unknown name, parameter or bad value raises.

    Off-policy rollouts (a Trainer that is ``off_policy``: an async pipeline, or an engine whose
    log-probs are not the trainer's; or a ``rollout_correction``) need ``old_log_probs``, the
    policy's log-probs before the update. With several optimizer steps per batch, or a correction
    that rejects tokens (it changes the loss's token count before the update), they are recomputed
    in a pass of their own (stage ``old_log_prob``) and corrected on the controller in
    ``advantage_step``. With one optimizer step per batch and no rejection, the weights cannot move
    before every micro-batch's forward has run, so the update takes them from its own forward
    (detached, the same values) and applies the IS weights there: the same loss without the extra
    pass. Either way the step logs how far the rollout policy is (verl's names):
    ``rollout_corr/kl`` (k1, token mean of ``rollout_log_probs - old_log_probs``),
    ``rollout_corr/k3_kl``, ``rollout_corr/chi2_token``, ``rollout_corr/chi2_seq``,
    ``rollout_corr/{training,rollout}_ppl``, ``rollout_corr/log_ppl_diff``; with a correction, also
    ``rollout_corr/rollout_is_{mean,max,min,eff_sample_size}``,
    ``rollout_corr/rollout_is_ratio_fraction_{high,low}`` (share of weights truncated) and
    ``rollout_corr/rollout_rs_{masked_fraction,seq_masked_fraction}`` (share of tokens / rows
    rejected). The IS weights (``rollout_is_weights [N, T]``) multiply the per-token policy loss;
    rejected tokens leave ``response_mask``, so they count in no loss term and no denominator.
    Computed inside the update, the metrics are combined over micro-batches and ranks
    (:func:`~rltrainer.algorithms.rollout_corr.share_of_batch`).
    """

    rollout_correction: str | None = None
    rollout_correction_kwargs: dict[str, Any] | None = None
    #: the entry's parameters, and whether it rejects tokens (then it needs the old log-probs first)
    params: dict[str, Any] = field(init=False, repr=False, compare=False)
    rejects: bool = field(init=False, repr=False, compare=False)

    kind: ClassVar[str] = "correction"
    reads: ClassVar[tuple[str, ...]] = ("old_log_probs", "rollout_log_probs", "response_mask")
    adds: ClassVar[tuple[str, ...]] = ("rollout_is_weights",)  # and rejected tokens leave response_mask

    def __post_init__(self) -> None:
        name, params = self.rollout_correction, dict(self.rollout_correction_kwargs or {})
        if name is None and self.rollout_correction_kwargs:
            raise ValueError(f"rollout_correction_kwargs={self.rollout_correction_kwargs!r} given without "
                             f"rollout_correction; name one of {', '.join(ROLLOUT_CORRECTIONS.names())}.")
        if name is not None:  # an unknown name, parameter or value raises here
            check_rollout_correction(name, params)
        self.params = params
        self.rejects = name is not None and rejects(name, params)

    def corrects(self, off_policy: bool) -> bool:
        """Whether rollouts are corrected: they can be off-policy (the Trainer's ``off_policy``), or a
        correction is named."""
        return off_policy or self.rollout_correction is not None

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return ("old_log_prob",) if self.corrects(off_policy) and self.rejects else ()

    def before_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        """Log the rollout/trainer mismatch and apply the correction (needs ``old_log_probs`` and
        ``rollout_log_probs``): adds ``rollout_is_weights [N, T]`` if the correction has weights, and
        sets rejected tokens of ``response_mask [N, T]`` to 0, as verl does before computing
        advantages. Without ``old_log_probs`` (one optimizer step, no rejection) it sets
        ``batch.correct_in_update`` and :meth:`update` does the same with its own forward's."""
        name = self.rollout_correction
        if name is not None and "rollout_log_probs" not in batch:
            raise KeyError(f"rollout_correction={name!r} needs 'rollout_log_probs' [N, T] in the "
                           f"batch (the default rollout_step adds them); it has {batch.keys()}")
        if "rollout_log_probs" not in batch or not batch["response_mask"].any():
            return batch
        if "old_log_probs" not in batch:
            if self.corrects(step.off_policy):
                if self.rejects:
                    raise KeyError(f"rollout_correction={name!r} rejects tokens, so it needs 'old_log_probs' before "
                                   f"the update (stage 'old_log_prob'); the batch has {batch.keys()}")
                batch.correct_in_update = True
            return batch
        old, rollout, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
        metrics = mismatch_metrics(old, rollout, mask)
        if name is not None:
            correction = ROLLOUT_CORRECTIONS.build(name, old_log_probs=old, rollout_log_probs=rollout,
                                                   response_mask=mask, **self.params)
            batch["response_mask"] = correction.response_mask  # [N, T], rejected tokens 0
            if correction.weights is not None:
                batch["rollout_is_weights"] = correction.weights  # [N, T], detached, 0 on padding
            metrics.update(correction.metrics)
        for metric, value in metrics.items():
            step.log(f"rollout_corr/{metric}", value)
        return batch

    def in_update(self, old_log_probs: torch.Tensor, micro_batch: RolloutBatch
                  ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """:meth:`before_advantages` inside the update, on one micro-batch whose ``old_log_probs
        [n, T]`` come from the update's own forward: the IS weights ``[n, T]`` (or ``None``) and the
        ``rollout_corr/*`` metrics as this micro-batch's share of the batch's."""
        mask = micro_batch["response_mask"]
        rollout = micro_batch["rollout_log_probs"]
        metrics = mismatch_metrics(old_log_probs, rollout, mask)
        weights = None
        if self.rollout_correction is not None:
            correction = ROLLOUT_CORRECTIONS.build(self.rollout_correction, old_log_probs=old_log_probs,
                                                   rollout_log_probs=rollout, response_mask=mask, **self.params)
            weights = correction.weights
            metrics.update(correction.metrics)
        shares = share_of_batch(metrics, mask, micro_batch.global_tokens, micro_batch.global_rows)
        return weights, {f"rollout_corr/{k}": v.detach() for k, v in shares.items()}

    def update(self, u: Update) -> None:
        mb = u.micro_batch
        u.is_weights = mb["rollout_is_weights"] if "rollout_is_weights" in mb else None
        if mb.correct_in_update:  # one optimizer step: old_log_probs are this forward's
            u.is_weights, metrics = self.in_update(u.old_log_probs, mb)
            u.metrics.update(metrics)

    def exposed(self) -> dict[str, Any]:
        return {**super().exposed(), "rollout_correction_kwargs": self.params}
