"""DAPO's pieces (Yu et al. 2025, arXiv:2503.14476): the soft overlong penalty (section 3.4) and
the groups that dynamic sampling keeps (section 3.2), as pure functions; and the three parts
:class:`~rltrainer.DAPO` adds to GRPO's, which call them: :class:`OverlongPenalty`,
:class:`TruncationMask` and :class:`DynamicSampling`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from rltrainer.algorithms.advantages import group_index
from rltrainer.algorithms.part import Part, Sampler, Setup, Step
from rltrainer.data.batch import RolloutBatch, concat_rollouts
from rltrainer.values import check_float, check_int

log = logging.getLogger(__name__)

#: The paper's overlong buffer as a share of the response budget: L_cache / L_max = 4096 / 20480.
OVERLONG_BUFFER_SHARE = 4096 / 20480


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[N]`` for response lengths ``[N]`` (tokens): 0 up to
    ``L_max - L_cache``, then falling linearly to ``-factor`` at ``L_max``::

        -factor * min(1, max(0, L - (L_max - L_cache)) / L_cache)

    verl's ``DAPORewardManager`` (verl/workers/reward_manager/dapo.py:117-121 at b178a3c):
    ``min(-(L - (max_resp_len - len)) / len * penalty_factor, 0)``, the same for ``L <= L_max`` (a
    response cannot be longer); the ``min(1, .)`` keeps it at ``-factor`` beyond.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"Need 0 < buffer_length <= max_length (L_cache within L_max), got buffer_length="
                         f"{buffer_length}, max_length={max_length}")
    exceed = (lengths.float() - (max_length - buffer_length)).clamp(min=0)  # [N]
    return -factor * (exceed / buffer_length).clamp(max=1.0)


def mixed_groups(scores: torch.Tensor, uids: Sequence[object]) -> list[list[int]]:
    """The rows of each group whose ``scores [N]`` are not all equal, groups in order of first
    appearance (dynamic sampling keeps these; a group of equal scores has zero advantage)."""
    groups = group_index(uids)  # [N]
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(groups.tolist()):
        rows.setdefault(group, []).append(row)
    return [members for members in rows.values() if scores[members].max() > scores[members].min()]


@dataclass
class OverlongPenalty(Part):
    """The soft overlong penalty added to the scores (section 3.4).

    Args:
        overlong_penalty_factor: the penalty at ``L_max`` (0: no overlong shaping; verl's 1.0).
        overlong_buffer_len: ``L_cache`` in tokens, where the penalty ramps up, ``L_max`` being
            ``max_new_tokens``. Default: ``max_new_tokens`` scaled by the paper's 4096 / 20480 (one
            fifth, rounded down, at least 1).

    After the rule rewards (``score``): ``task_scores [N]`` (the reward functions'),
    ``overlong_penalty [N]`` and ``scores [N]`` (their sum). Lengths are the generated tokens of
    ``response_mask`` (verl's ``valid_response_length``). Logs, on the rows trained on:
    ``critic/task_score/mean`` (before the penalty), ``overlong/penalty_mean``, ``overlong/penalized_share``.
    """

    overlong_penalty_factor: float = 1.0
    overlong_buffer_len: int | None = None

    kind: ClassVar[str] = "overlong"
    reads: ClassVar[tuple[str, ...]] = ("scores", "response_mask")
    adds: ClassVar[tuple[str, ...]] = ("task_scores", "overlong_penalty")

    def __post_init__(self) -> None:
        self.overlong_penalty_factor = check_float("overlong_penalty_factor", self.overlong_penalty_factor, at_least=0,
                                                   meaning="0: no overlong shaping", owner="DAPO")

    def buffer_len(self, max_length: int) -> int:
        """``L_cache`` for ``L_max = max_length``: the setting, or the paper's share of it."""
        given = self.overlong_buffer_len
        return given if given is not None else max(1, int(max_length * OVERLONG_BUFFER_SHARE))

    def check(self, setup: Setup) -> None:
        check_int("overlong_buffer_len", self.buffer_len(setup.max_new_tokens), at_least=1,
                  at_most=setup.max_new_tokens, owner="DAPO",
                  meaning="L_cache within L_max = max_new_tokens; None: max_new_tokens / 5")

    def score(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        batch["task_scores"] = batch["scores"].clone()  # [N]
        penalty = torch.zeros_like(batch["task_scores"])  # [N]
        if self.overlong_penalty_factor:
            lengths = batch["response_mask"].sum(-1)  # [N]
            penalty = overlong_penalty(lengths, step.max_new_tokens, self.buffer_len(step.max_new_tokens),
                                       self.overlong_penalty_factor).to(penalty.dtype)
        batch["overlong_penalty"] = penalty  # [N]
        batch["scores"] = batch["task_scores"] + penalty  # [N]
        return batch

    def before_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        if "overlong_penalty" not in batch:  # scored without this module's score (a batch made by hand)
            return batch
        penalty = batch["overlong_penalty"]
        step.log("critic/task_score/mean", batch["task_scores"].mean().item())
        step.log("overlong/penalty_mean", penalty.mean().item())
        step.log("overlong/penalized_share", (penalty < 0).float().mean().item())
        return batch


@dataclass
class TruncationMask(Part):
    """Responses cut at ``max_new_tokens`` (``finish_reason == "length"``) leave ``response_mask
    [N, T]`` before the advantages: no loss term, no token in any count (the paper's overlong
    filtering, section 3.4). Their scores still enter their group's statistics, as with TRL's
    ``mask_truncated_completions``. Logs ``overlong/masked_share``.

    Args:
        mask_truncated: on (``False``: verl's recipe, which has it not).
    """

    mask_truncated: bool = True

    kind: ClassVar[str] = "truncation"
    reads: ClassVar[tuple[str, ...]] = ("finish_reason", "response_mask")

    def fields_read(self) -> frozenset[str]:
        return frozenset(self.reads) if self.mask_truncated else frozenset()

    def before_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        if not self.mask_truncated:
            return batch
        if "finish_reason" not in batch:
            raise KeyError(f"mask_truncated=True needs 'finish_reason' (one per row, 'length' for a truncated "
                           f"response; the default rollout_step adds it); the batch has {batch.keys()}. Add "
                           f"it in rollout_step, or set mask_truncated=False.")
        truncated = torch.tensor([reason == "length" for reason in batch["finish_reason"]], dtype=torch.bool)
        mask = batch["response_mask"]
        batch["response_mask"] = mask * (~truncated).to(mask.dtype).unsqueeze(-1)  # [N, T]
        step.log("overlong/masked_share", truncated.float().mean().item())
        return batch


@dataclass
class DynamicSampling(Part):
    """Dynamic sampling (section 3.2): the group filter in ``rollout_step``.

    Args:
        dynamic_sampling: drop groups whose rewards (before the overlong penalty, ``task_scores``:
            the paper's accuracy, verl's ``filter_groups.metric="acc"``) are all equal, and generate
            the next loader batches until ``B`` groups are mixed, ``B`` being the loader's batch
            size. Needs ``Trainer(pipeline="sync")``; ``fit`` refuses the other pipelines.
        max_gen_rounds: generation rounds one step may use (verl's ``max_num_gen_batches``, 10 in its
            DAPO docs; ``None``: no bound). Still short after them, the step raises, as verl does.

    Step by step: sample ``G`` responses for the ``B`` prompts, score them (so ``reward_step``
    later only logs), keep the groups with mixed rewards, and while fewer than ``B`` are kept ask
    for the next loader batch and sample again. It trains on the first ``B`` mixed groups (verl:
    ``batch[:traj_bsz]``); the surplus is dropped, counted. Called by hand (no Trainer), it filters
    the groups of the prompts it is given and draws none. Metrics: ``dynamic_sampling/gen_rounds``,
    ``dynamic_sampling/generated_groups``, ``dynamic_sampling/dropped_group_share``,
    ``dynamic_sampling/surplus_groups``, ``dynamic_sampling/short_groups``.
    """

    dynamic_sampling: bool = True
    max_gen_rounds: int | None = 10

    kind: ClassVar[str] = "group_filter"
    reads: ClassVar[tuple[str, ...]] = ("task_scores", "uid")
    supported_pipelines: ClassVar[tuple[str, ...] | None] = ("sync",)
    pipeline_reason: ClassVar[str] = (
        "DAPO's dynamic sampling draws further prompts from the loader inside the step (RLModule.draw_prompts), "
        "which the pipelines that queue prompts ahead cannot offer. Use Trainer(pipeline='sync'), or "
        "DAPO(dynamic_sampling=False).")

    def __post_init__(self) -> None:
        self.max_gen_rounds = check_int("max_gen_rounds", self.max_gen_rounds, at_least=1, none="no bound",
                                        meaning="generation rounds per step", owner="DAPO")

    def fields_read(self) -> frozenset[str]:
        return frozenset(self.reads) if self.dynamic_sampling else frozenset()

    def pipelines(self) -> tuple[str, ...] | None:
        return self.supported_pipelines if self.dynamic_sampling else None

    def check(self, setup: Setup) -> None:
        if self.dynamic_sampling and setup.reward_model:
            raise ValueError("DAPO's dynamic sampling filters groups by their scores inside rollout_step, before the "
                             "compute stages run, so a RewardModel's scores (stage 'reward_model') are not there yet. "
                             "Use rule rewards with dynamic sampling, or DAPO(dynamic_sampling=False) with a "
                             "RewardModel.")

    def rollout(self, prompts: RolloutBatch, sampler: Sampler, step: Step) -> RolloutBatch | None:
        if not self.dynamic_sampling:
            return None
        target, G = len(prompts), sampler.group_size
        kept: list[RolloutBatch] = []  # one entry per mixed group, [G] rows each
        batch: RolloutBatch | None = prompts
        rounds = generated = 0
        while batch is not None:
            rounds += 1
            rows = sampler.sample(batch)  # scored: task_scores, scores [n]
            groups = mixed_groups(rows["task_scores"], rows["uid"])
            generated += len(rows) // G
            kept.extend(rows[members] for members in groups)
            if len(kept) >= target:
                break
            if self.max_gen_rounds is not None and rounds >= self.max_gen_rounds:
                raise RuntimeError(self._bound_message(len(kept), target, rounds, generated))
            batch = sampler.draw_prompts() if sampler.draw_prompts is not None else None  # None: no more data
        self._log(step, rounds, generated, len(kept), target)
        if not kept:  # the data ran out with no mixed group: the pipeline ends the run
            return rows[torch.zeros(0, dtype=torch.long)]
        return concat_rollouts(kept[:target], sampler.pad_token_id)

    def _bound_message(self, kept: int, target: int, rounds: int, generated: int) -> str:
        return (f"Dynamic sampling kept {kept} of the {target} groups a step needs after {rounds} generation rounds "
                f"(max_gen_rounds={self.max_gen_rounds}): {generated - kept} of {generated} groups had all-equal "
                f"rewards. The prompts may be too easy or too hard for the policy, or the reward constant. Raise "
                f"max_gen_rounds (None: no bound), check the reward and data, or set dynamic_sampling=False.")

    @staticmethod
    def _log(step: Step, rounds: int, generated: int, kept: int, target: int) -> None:
        step.log("dynamic_sampling/gen_rounds", rounds)
        step.log("dynamic_sampling/generated_groups", generated)
        step.log("dynamic_sampling/dropped_group_share", (generated - kept) / max(generated, 1))
        step.log("dynamic_sampling/surplus_groups", max(kept - target, 0))
        step.log("dynamic_sampling/short_groups", max(target - kept, 0))
        if kept < target:
            log.warning("Dynamic sampling ran out of prompts with %d of %d mixed groups; the step trains on %s.",
                        kept, target, "them" if kept else "nothing (in fit, the run ends)")
