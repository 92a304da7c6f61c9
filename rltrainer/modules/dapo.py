"""DAPO (Yu et al. 2025, arXiv:2503.14476): :class:`~rltrainer.modules.PolicyGradient` with GRPO's
parts, three of its own (:mod:`rltrainer.algorithms.dapo`: dynamic sampling, the soft overlong
penalty, truncated responses masked out of the loss) and the paper's defaults (clip-higher,
token-mean, no KL). The loop is the same; the only thing DAPO asks of it is more prompts
(``RLModule.draw_prompts``)."""

from __future__ import annotations

from typing import Any, ClassVar

from rltrainer.algorithms.dapo import DynamicSampling, OverlongPenalty, TruncationMask
from rltrainer.algorithms.part import Part
from rltrainer.modules.policy_gradient import PolicyGradient


class DAPO(PolicyGradient):
    """Decoupled Clip and Dynamic sAmpling Policy Optimization, with the paper's defaults.

    :class:`~rltrainer.modules.PolicyGradient` with GRPO's parts and these (each documents its
    settings, which ``DAPO(...)`` also takes flat):

    - :class:`~rltrainer.algorithms.parts.TruncationMask` (``truncation``): ``mask_truncated=True``,
      responses cut at ``max_new_tokens`` count in no loss term and no token count (section 3.4;
      Table 1 adds each technique to the previous ones, so DAPO has it; verl's recipe has not,
      ``mask_truncated=False`` matches it);
    - :class:`~rltrainer.algorithms.parts.OverlongPenalty` (``overlong``):
      ``overlong_penalty_factor=1.0``, ``overlong_buffer_len`` (default ``max_new_tokens / 5``);
    - :class:`~rltrainer.algorithms.parts.DynamicSampling` (``group_filter``):
      ``dynamic_sampling=True``, ``max_gen_rounds=10`` (needs ``Trainer(pipeline="sync")``).

    The defaults that differ from GRPO's (:attr:`preset`): ``clip_ratio_high=0.28`` (clip-higher,
    ``[1 - 0.2, 1 + 0.28]``, section 3.1), ``clip_ratio_c=None`` (no dual clip, the paper's
    objective, eq. 8; verl's DAPO recipe uses 10), ``num_generations=16`` (section 4.1);
    ``loss_agg_mode="token-mean"`` (section 3.3) and ``kl_coef=0`` (section 2.3) are GRPO's too.

    Drawn batches are consumed: the epoch and a resume move past them, so one step can use several
    loader batches and an epoch has fewer steps than batches. At the end of the data it trains on
    the mixed groups it has (fewer than ``B``, logged as ``short_groups``), or ends the run if it
    has none. ``critic/score/*`` are the trained rows' shaped scores; the reward functions' own
    ``reward/*`` metrics are the last round's.
    """

    PARTS: ClassVar[dict[str, type[Part] | None]] = {"truncation": TruncationMask, **PolicyGradient.PARTS,
                                                      "overlong": OverlongPenalty, "group_filter": DynamicSampling}
    preset: ClassVar[dict[str, Any]] = {"clip_ratio_high": 0.28, "clip_ratio_c": None, "num_generations": 16}
