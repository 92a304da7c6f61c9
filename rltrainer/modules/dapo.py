"""DAPO (Yu et al. 2025, arXiv:2503.14476) as policy gradient with four hooks' worth of changes: dynamic
sampling in ``rollout_step``, the soft overlong penalty in ``reward_step``, truncated responses
masked out of the loss in ``advantage_step``, and clip-higher / token-mean / no KL as defaults.
The loop is the same; the only thing DAPO asks of it is more prompts (``RLModule.draw_prompts``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rltrainer.algorithms.dapo import mixed_groups, overlong_penalty
from rltrainer.data.batch import RolloutBatch, concat_rollouts
from rltrainer.models import ModelSpec
from rltrainer.modules.policy_gradient import PolicyGradient
from rltrainer.rewards.model import RewardSpec
from rltrainer.rollout.engine import RolloutEngine
from rltrainer.values import check_float, check_int

log = logging.getLogger(__name__)

#: The paper's overlong buffer as a share of the response budget: L_cache / L_max = 4096 / 20480.
OVERLONG_BUFFER_SHARE = 4096 / 20480


class DAPO(PolicyGradient):
    """Decoupled Clip and Dynamic sAmpling Policy Optimization, with the paper's defaults.

    :class:`~rltrainer.modules.PolicyGradient` with GRPO's parts and the paper's settings, plus four
    hooks' worth of its own. Takes every :class:`~rltrainer.GRPO` argument; these differ or are new:

    Args:
        clip_ratio_low, clip_ratio_high: clip-higher, ``[1 - 0.2, 1 + 0.28]`` (paper, section 3.1;
            settings of :class:`~rltrainer.algorithms.parts.PolicyLoss`, as the next two).
        clip_ratio_c: ``None``: no dual clip (the paper's objective, eq. 8; verl's DAPO recipe uses 10).
        loss_agg_mode: ``"token-mean"`` (section 3.3); ``kl_coef``: 0, no reference model (section 2.3).
        num_generations: 16 (section 4.1).
        dynamic_sampling: drop groups whose rewards (before the overlong penalty: the paper's
            accuracy, verl's ``filter_groups.metric="acc"``) are all equal, and generate the next
            loader batches until ``B`` groups are mixed (section 3.2), ``B`` being the loader's batch
            size. Needs ``Trainer(pipeline="sync")``; ``fit`` refuses the other pipelines.
        max_gen_rounds: generation rounds one step may use (verl's ``max_num_gen_batches``, 10 in its
            DAPO docs; ``None``: no bound). Still short after them, the step raises, as verl does.
        overlong_penalty_factor: the penalty at ``L_max`` (0: no overlong shaping; verl's 1.0).
        overlong_buffer_len: ``L_cache`` in tokens, where the penalty ramps up, ``L_max`` being
            ``max_new_tokens``. Default: ``max_new_tokens`` scaled by the paper's 4096 / 20480 (one
            fifth, rounded down, at least 1).
        mask_truncated: responses cut at ``max_new_tokens`` (``finish_reason == "length"``) count in
            no loss term and no token count (the paper's overlong filtering, section 3.4; Table 1
            adds each technique to the previous ones, so DAPO has it; verl's recipe has not,
            ``mask_truncated=False`` matches it). Their scores still enter their group's statistics,
            as with TRL's ``mask_truncated_completions``.

    Dynamic sampling, step by step: ``rollout_step`` samples ``G`` responses for its ``B`` prompts,
    scores them (so ``reward_step`` later only logs), keeps the groups with mixed rewards, and while
    fewer than ``B`` are kept asks ``self.draw_prompts()`` for the next loader batch and samples
    again. It trains on the first ``B`` mixed groups (verl: ``batch[:traj_bsz]``); the surplus is
    dropped, counted. Drawn batches are consumed: the epoch and a resume move past them, so one step
    can use several loader batches and an epoch has fewer steps than batches. At the end of the data
    it trains on the mixed groups it has (fewer than ``B``, logged as ``short_groups``), or ends the
    run if it has none. Metrics: ``dynamic_sampling/gen_rounds`` (verl's ``train/num_gen_batches``),
    ``dynamic_sampling/generated_groups``, ``dynamic_sampling/dropped_group_share`` (groups with equal
    rewards over those generated), ``dynamic_sampling/surplus_groups``, ``dynamic_sampling/short_groups``;
    ``overlong/penalty_mean``, ``overlong/penalized_share``, ``overlong/masked_share`` (rows masked as
    truncated); ``critic/task_score/mean`` (before the penalty). ``critic/score/*`` are the trained
    rows' shaped scores; the reward functions' own ``reward/*`` metrics are the last round's.
    """

    #: the paper's loss settings (clip-higher, no dual clip); token-mean and no KL are the defaults
    preset = {"clip_ratio_high": 0.28, "clip_ratio_c": None}

    def __init__(
        self,
        model: ModelSpec,
        tokenizer: Any,
        reward_funcs: Sequence[RewardSpec] | RewardSpec | None,
        *,
        num_generations: int = 16,
        max_new_tokens: int = 512,
        dynamic_sampling: bool = True,
        max_gen_rounds: int | None = 10,
        overlong_penalty_factor: float = 1.0,
        overlong_buffer_len: int | None = None,
        mask_truncated: bool = True,
        **settings: Any,
    ) -> None:
        super().__init__(model, tokenizer, reward_funcs, num_generations=num_generations, max_new_tokens=max_new_tokens,
                         **settings)
        max_gen_rounds = check_int("max_gen_rounds", max_gen_rounds, at_least=1, none="no bound",
                                   meaning="generation rounds per step", owner="DAPO")
        overlong_penalty_factor = check_float("overlong_penalty_factor", overlong_penalty_factor, at_least=0,
                                              meaning="0: no overlong shaping", owner="DAPO")
        if overlong_buffer_len is None:
            overlong_buffer_len = max(1, int(max_new_tokens * OVERLONG_BUFFER_SHARE))
        overlong_buffer_len = check_int("overlong_buffer_len", overlong_buffer_len, at_least=1, at_most=max_new_tokens,
                                        meaning="L_cache within L_max = max_new_tokens; None: max_new_tokens / 5",
                                        owner="DAPO")
        self.dynamic_sampling, self.max_gen_rounds = dynamic_sampling, max_gen_rounds
        self.overlong_penalty_factor, self.overlong_buffer_len = overlong_penalty_factor, overlong_buffer_len
        self.mask_truncated = mask_truncated
        if dynamic_sampling and self.reward_model_spec is not None:
            raise ValueError("DAPO's dynamic sampling filters groups by their scores inside rollout_step, before the "
                             "compute stages run, so a RewardModel's scores (stage 'reward_model') are not there yet. "
                             "Use rule rewards with dynamic sampling, or DAPO(dynamic_sampling=False) with a "
                             "RewardModel.")
        if dynamic_sampling:
            self.supported_pipelines = ("sync",)
            self.pipeline_reason = ("DAPO's dynamic sampling draws further prompts from the loader inside the step "
                                    "(RLModule.draw_prompts), which the pipelines that queue prompts ahead cannot "
                                    "offer. Use Trainer(pipeline='sync'), or DAPO(dynamic_sampling=False).")

    # -- control flow ---------------------------------------------------------------------------
    def rollout_step(self, batch: RolloutBatch, engine: RolloutEngine) -> RolloutBatch:
        """The default sampling; with ``dynamic_sampling``, scored and filtered, drawing more prompts
        until ``B`` groups have mixed rewards (see the class docstring). Returns ``N <= B*G`` rows.
        Called by hand (no Trainer), it filters the groups of the prompts it is given and draws none."""
        if not self.dynamic_sampling:
            return super().rollout_step(batch, engine)
        target, G = len(batch), self.sampling.n
        kept: list[RolloutBatch] = []  # one entry per mixed group, [G] rows each
        prompts: RolloutBatch | None = batch
        rounds = generated = 0
        while prompts is not None:
            rounds += 1
            rows = self.score(super().rollout_step(prompts, engine))  # + task_scores, scores [n]
            groups = mixed_groups(rows["task_scores"], rows["uid"])
            generated += len(rows) // G
            kept.extend(rows[members] for members in groups)
            if len(kept) >= target:
                break
            if self.max_gen_rounds is not None and rounds >= self.max_gen_rounds:
                raise RuntimeError(self._bound_message(len(kept), target, rounds, generated))
            prompts = self.draw_prompts() if self._prompt_source is not None else None  # None: no more data
        self._log_sampling(rounds, generated, len(kept), target)
        if not kept:  # the data ran out with no mixed group: the pipeline ends the run
            return rows[torch.zeros(0, dtype=torch.long)]
        return concat_rollouts(kept[:target], self.tokenizer.pad_token_id)

    def _bound_message(self, kept: int, target: int, rounds: int, generated: int) -> str:
        return (f"Dynamic sampling kept {kept} of the {target} groups a step needs after {rounds} generation rounds "
                f"(max_gen_rounds={self.max_gen_rounds}): {generated - kept} of {generated} groups had all-equal "
                f"rewards. The prompts may be too easy or too hard for the policy, or the reward constant. Raise "
                f"max_gen_rounds (None: no bound), check the reward and data, or set dynamic_sampling=False.")

    def _log_sampling(self, rounds: int, generated: int, kept: int, target: int) -> None:
        self.log("dynamic_sampling/gen_rounds", rounds)
        self.log("dynamic_sampling/generated_groups", generated)
        self.log("dynamic_sampling/dropped_group_share", (generated - kept) / max(generated, 1))
        self.log("dynamic_sampling/surplus_groups", max(kept - target, 0))
        self.log("dynamic_sampling/short_groups", max(target - kept, 0))
        if kept < target:
            log.warning("Dynamic sampling ran out of prompts with %d of %d mixed groups; the step trains on %s.",
                        kept, target, "them" if kept else "nothing (in fit, the run ends)")

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """The rule rewards (:meth:`PolicyGradient.reward_step`), then the overlong penalty:
        ``task_scores [N]`` (the reward functions'), ``overlong_penalty [N]`` and ``scores [N]``
        (their sum). Lengths are the generated tokens of ``response_mask`` (verl's
        ``valid_response_length``); ``L_max`` is ``max_new_tokens``."""
        batch = super().reward_step(batch)
        batch["task_scores"] = batch["scores"].clone()  # [N]
        penalty = torch.zeros_like(batch["task_scores"])  # [N]
        if self.overlong_penalty_factor:
            lengths = batch["response_mask"].sum(-1)  # [N]
            penalty = overlong_penalty(lengths, self.sampling.max_new_tokens, self.overlong_buffer_len,
                                       self.overlong_penalty_factor).to(penalty.dtype)
        batch["overlong_penalty"] = penalty  # [N]
        batch["scores"] = batch["task_scores"] + penalty  # [N]
        return batch

    def reward_step(self, batch: RolloutBatch) -> RolloutBatch:
        """:meth:`score` (already done by ``rollout_step`` under dynamic sampling, which needs the
        scores to filter), then the metrics of the rows trained on."""
        if "task_scores" not in batch:
            batch = self.score(batch)
        scores, penalty = batch["scores"], batch["overlong_penalty"]
        self.log("critic/score/mean", scores.mean().item())
        self.log("critic/score/max", scores.max().item())
        self.log("critic/score/min", scores.min().item())
        self.log("critic/task_score/mean", batch["task_scores"].mean().item())
        self.log("overlong/penalty_mean", penalty.mean().item())
        self.log("overlong/penalized_share", (penalty < 0).float().mean().item())
        return batch

    def advantage_step(self, batch: RolloutBatch) -> RolloutBatch:
        """With ``mask_truncated``, rows cut at ``max_new_tokens`` leave ``response_mask [N, T]``
        (all zero: no loss term, no token in any count); then the parts' advantage step."""
        if self.mask_truncated:
            if "finish_reason" not in batch:
                raise KeyError(f"mask_truncated=True needs 'finish_reason' (one per row, 'length' for a truncated "
                               f"response; the default rollout_step adds it); the batch has {batch.keys()}. Add "
                               f"it in rollout_step, or set mask_truncated=False.")
            truncated = torch.tensor([reason == "length" for reason in batch["finish_reason"]], dtype=torch.bool)
            mask = batch["response_mask"]
            batch["response_mask"] = mask * (~truncated).to(mask.dtype).unsqueeze(-1)  # [N, T]
            self.log("overlong/masked_share", truncated.float().mean().item())
        return super().advantage_step(batch)
