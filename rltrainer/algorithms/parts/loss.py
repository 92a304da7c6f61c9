"""The loss parts: the policy loss (an entry of :data:`~rltrainer.algorithms.POLICY_LOSSES`, with
the entropy bonus and the aggregation every loss term shares) and the KL penalty to a reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.aggregation import AGGREGATIONS, aggregate, masked_sum_over
from rltrainer.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rltrainer.algorithms.losses import POLICY_LOSSES, LossContext, check_policy_loss
from rltrainer.algorithms.part import Part, Step, Update, settings_of
from rltrainer.data.batch import RolloutBatch
from rltrainer.registry import entry_params
from rltrainer.values import check_float


@dataclass
class PolicyLoss(Part):
    """The policy-gradient loss: a registered entry, plus the entropy bonus, aggregated alike.

    Args:
        policy_loss: an entry of :data:`~rltrainer.algorithms.POLICY_LOSSES`: ``"ppo_clip"``
            (default), ``"gspo"``, ``"cispo"``, ``"sapo"``, ``"dppo_tv"``, ``"dppo_kl"``,
            ``"clip_cov"``, ``"kl_cov"``, or one registered by the user.
        policy_loss_kwargs: that entry's parameters, overriding its registered defaults
            (``POLICY_LOSSES.defaults(name)``). An unknown name, parameter or bad value raises here.
        clip_ratio_low, clip_ratio_high: the asymmetric PPO clip range ``[1-low, 1+high]``
            (DAPO's clip-higher: ``high=0.28``): shorthands for the loss's parameters of those names.
            Left at their defaults they leave the entry's own (GSPO's are 3e-4, 4e-4); changed, they
            set it (refused if the loss has no such parameter, or ``policy_loss_kwargs`` sets it too).
        clip_ratio_c: dual-clip cap for negative advantages (``None``: off), the same kind of shorthand.
        entropy_coef: weight of the entropy bonus.
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"`` or
            ``"seq-mean-token-sum-norm"`` (Dr. GRPO), for every loss term (KL and value loss too).

    Needs the stage ``old_log_prob`` when the entry selects tokens from the whole batch (a
    ``prepare``: Clip-Cov, KL-Cov); its outputs travel in the batch, named in ``batch.loss_extras``.
    """

    policy_loss: str = "ppo_clip"
    policy_loss_kwargs: dict[str, Any] | None = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    #: the entry's full parameters (its defaults, the kwargs, the shorthands), checked
    params: dict[str, Any] = field(init=False, repr=False, compare=False)

    kind: ClassVar[str] = "loss"
    reads: ClassVar[tuple[str, ...]] = ("advantages", "response_mask", "old_log_probs", "rollout_is_weights")
    adds: ClassVar[tuple[str, ...]] = ()  # and the entry's prepare's outputs (batch.loss_extras)
    #: the settings that set the loss's parameter of the same name, with their defaults
    shorthands: ClassVar[dict[str, tuple[str, Any]]] = {
        "clip_ratio_low": ("clip_ratio_low", 0.2), "clip_ratio_high": ("clip_ratio_high", 0.2),
        "clip_ratio_c": ("clip_ratio_c", 3.0)}

    def __post_init__(self) -> None:
        AGGREGATIONS.get(self.loss_agg_mode)  # an unknown name raises here
        low = self.clip_ratio_low = check_float("clip_ratio_low", self.clip_ratio_low, at_least=0, below=1,
                                                meaning="the ratio's clip below 1: 1 - low")
        high = self.clip_ratio_high = check_float("clip_ratio_high", self.clip_ratio_high, at_least=0,
                                                  meaning="the ratio's clip above 1: 1 + high")
        cap = self.clip_ratio_c = check_float("clip_ratio_c", self.clip_ratio_c, above=1, none="no dual clip",
                                              meaning="the dual-clip cap")
        self.entropy_coef = check_float("entropy_coef", self.entropy_coef, meaning="weight of the entropy bonus")
        # the entry itself travels with the module (pickled to the training ranks), so a loss a user
        # registered in their script is there even where their registration never ran
        self._fn = POLICY_LOSSES.get(self.policy_loss)
        self.params = check_policy_loss(self.policy_loss, entry_params(
            "policy loss", self.policy_loss, POLICY_LOSSES.defaults(self.policy_loss), self.policy_loss_kwargs,
            {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": cap}, self.shorthands))

    @property
    def prepare(self) -> Callable[..., dict[str, torch.Tensor]] | None:
        """The entry's batch-level token selection (Clip-Cov, KL-Cov), or ``None``."""
        return getattr(self._fn, "prepare", None)

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return ("old_log_prob",) if self.prepare is not None else ()

    def after_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        if self.prepare is not None:
            extras = self.prepare(batch["old_log_probs"], batch["advantages"], batch["response_mask"], **self.params)
            for name, value in extras.items():
                batch[name] = value  # [N, T]
            batch.loss_extras = sorted(extras)
        return batch

    def update(self, u: Update) -> None:
        mb, mask = u.micro_batch, u.micro_batch["response_mask"]
        ctx = LossContext(u.loss_agg_mode, **u.counts, rollout_is_weights=u.is_weights,
                          extras={k: mb[k] for k in mb.loss_extras})
        pg_loss, metrics = self._fn(u.log_probs, u.old_log_probs, mb["advantages"], mask, ctx, **self.params)
        u.metrics.update(metrics)
        loss = pg_loss
        u.metrics["actor/pg_loss"] = pg_loss.detach()
        u.metrics["actor/entropy"] = masked_sum_over(u.entropy.detach(), mask, mb.global_tokens)
        if self.entropy_coef != 0:
            loss = loss - self.entropy_coef * aggregate(u.entropy, mask, u.loss_agg_mode, **u.counts)
        u.add(loss)

    def exposed(self) -> dict[str, Any]:
        """This part's settings, flat (``policy_loss_kwargs``: the full ones)."""
        return {**settings_of(self), "policy_loss_kwargs": self.params}


@dataclass
class KLPenalty(Part):
    """A KL-to-reference term in the loss (the reference part).

    Args:
        kl_coef: weight of the KL-to-reference loss (0: no term, and no reference model for it).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (``"low_var_kl"``).
    """

    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    kind: ClassVar[str] = "kl"
    reads: ClassVar[tuple[str, ...]] = ("ref_log_probs",)

    def __post_init__(self) -> None:
        KL_ESTIMATORS.get(self.kl_estimator)  # an unknown name raises here
        self.kl_coef = check_float("kl_coef", self.kl_coef, at_least=0, meaning="0: no KL term")

    def fields_read(self) -> frozenset[str]:
        return frozenset(self.reads) if self.kl_coef > 0 else frozenset()

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return ("ref",) if self.kl_coef > 0 else ()

    def update(self, u: Update) -> None:
        if self.kl_coef > 0:
            kl = kl_penalty(u.log_probs, u.micro_batch["ref_log_probs"], self.kl_estimator)
            kl_loss = aggregate(kl, u.micro_batch["response_mask"], u.loss_agg_mode, **u.counts)
            u.add(self.kl_coef * kl_loss)
            u.metrics["actor/kl_loss"] = kl_loss.detach()

