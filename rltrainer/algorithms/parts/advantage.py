"""The advantage part: an entry of :data:`~rltrainer.algorithms.ADVANTAGES` with its parameters,
run once per batch on the controller; and the one with GAE's shorthands that a critic goes with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.advantages import (ADVANTAGES, AdvantageContext, check_advantage, check_group_size,
                                             required_fields)
from rltrainer.algorithms.kl import kl_penalty
from rltrainer.algorithms.part import STAGE_FIELDS, Part, Setup, Step
from rltrainer.data.batch import RolloutBatch
from rltrainer.registry import entry_params


@dataclass
class Advantage(Part):
    """The advantage estimator.

    Args:
        advantage_estimator: an entry of :data:`~rltrainer.algorithms.ADVANTAGES`: ``"grpo"``,
            ``"dr_grpo"``, ``"rloo"``, ``"reinforce"``, ``"opo"``, ``"reinforce_plus_plus"``,
            ``"reinforce_plus_plus_baseline"``, ``"remax"`` (the module's ``rollout_step`` then also
            generates one greedy response per prompt, and ``reward_step`` scores it as the
            baseline); ``"gae"`` needs a critic (:class:`~rltrainer.PPO`).
        advantage_kwargs: that entry's parameters (e.g. ``{"kl_in_reward_coef": 0.01}``: a KL
            penalty in the token rewards, which builds a reference model), overriding its defaults;
            an unknown name, parameter or bad value raises here.
        norm_adv_by_std: divide advantages by the group std (``False``: Dr. GRPO): a shorthand for
            the estimator's ``norm_by_std`` (left at its default it leaves the entry's own; changed,
            it sets it, and is refused if the entry has none).

    Reads ``scores [N]``, ``response_mask``, ``uid`` and what the entry requires (``old_log_probs``
    and ``ref_log_probs`` for a KL in the reward: it asks for their stages; ``values`` from a
    critic; ``reward_baselines`` from the greedy baseline); adds ``advantages`` and ``returns [N, T]``.
    """

    advantage_estimator: str = "grpo"
    advantage_kwargs: dict[str, Any] | None = None
    norm_adv_by_std: bool = True
    #: the entry's full parameters, checked, and the context fields it needs with them
    params: dict[str, Any] = field(init=False, repr=False, compare=False)
    fields: set[str] = field(init=False, repr=False, compare=False)

    #: this part's shorthands: argument -> (the entry's parameter, the argument's default)
    shorthands: ClassVar[dict[str, tuple[str, Any]]] = {"norm_adv_by_std": ("norm_by_std", True)}
    kind: ClassVar[str] = "advantage"
    adds: ClassVar[tuple[str, ...]] = ("advantages", "returns")

    def __post_init__(self) -> None:
        name = self.advantage_estimator
        self._fn = ADVANTAGES.get(name)  # travels with the module, as the policy loss does
        arguments = {arg: getattr(self, arg) for arg in self.shorthands}
        self.params = check_advantage(name, entry_params("advantage estimator", name, ADVANTAGES.defaults(name),
                                                         self.advantage_kwargs, arguments, self.shorthands))
        self.fields = required_fields(name, self.params)

    def fields_read(self) -> frozenset[str]:
        return frozenset({"scores", "response_mask", "uid", *self.fields})

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        return tuple(stage for stage in ("old_log_prob", "ref") if STAGE_FIELDS[stage] in self.fields)

    def check(self, setup: Setup) -> None:
        name = self.advantage_estimator
        check_group_size(name, setup.num_generations)
        if "values" in self.fields and "values" not in setup.stages:
            critic_free = [n for n in ADVANTAGES if "values" not in required_fields(n, ADVANTAGES.defaults(n))]
            raise ValueError(f"advantage_estimator={name!r} needs a critic's values [N, T], and {setup.owner} trains "
                             f"no critic. Use rltrainer.PPO (a critic trained alongside the policy), or a "
                             f"critic-free estimator: {', '.join(critic_free)}.")
        if "reward_baselines" not in self.fields:
            return
        if setup.environment:
            raise ValueError(f"advantage_estimator={name!r} scores one greedy single-turn response per prompt as its "
                             "baseline, which an environment's episodes do not have. Use another estimator with "
                             "environment=..., e.g. 'grpo' or 'rloo'.")
        if not setup.rule_rewards or setup.reward_model:
            raise ValueError(f"advantage_estimator={name!r} scores a greedy baseline response with the rule rewards "
                             "on the controller; it needs rule rewards and no RewardModel (the baseline has no "
                             "tokens on the training ranks). Use another estimator, e.g. 'grpo'.")

    def estimate(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator's ``(advantages, returns)`` ``[N, T]``. Rows in ``reward_invalid [N]`` (a
        reward function scored them NaN or inf) are left out: the estimator runs on the other rows
        (so they do not move a group's mean or std), and these get advantage 0 and leave
        ``response_mask`` (no loss term, no token in any count)."""
        missing = sorted(f for f in self.fields if f not in batch)
        if missing:
            raise KeyError(f"advantage_estimator={self.advantage_estimator!r} needs {missing} in the batch (the "
                           f"stages of compute_stages and GRPO's rollout/reward steps add them); it has {batch.keys()}")
        invalid = batch["reward_invalid"] if "reward_invalid" in batch else None
        if invalid is None or not invalid.any():
            return self._run(batch)
        keep = (~invalid).nonzero().flatten()  # [N'] rows with finite rewards
        mask = batch["response_mask"]
        advantages = torch.zeros(mask.shape, dtype=torch.float32)  # [N, T]
        returns = torch.zeros(mask.shape, dtype=torch.float32)  # [N, T]
        if len(keep):
            kept_advantages, kept_returns = self._run(batch[keep])
            advantages[keep], returns[keep] = kept_advantages.float(), kept_returns.float()
        batch["response_mask"] = mask * (~invalid).to(mask.dtype).unsqueeze(-1)  # [N, T]
        return advantages, returns

    def _run(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = AdvantageContext(**{f: batch[f] for f in self.fields}, token_level_scores=batch.get("token_level_scores"))
        return self._fn(batch["scores"], batch["response_mask"], batch["uid"], ctx, **self.params)

    def after_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        if self.params.get("kl_in_reward_coef"):
            mask = batch["response_mask"].bool()
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.params["kl_estimator"])
            step.log("critic/kl_in_reward", kl[mask].mean().item() if mask.any() else 0.0)
        return batch

    def exposed(self) -> dict[str, Any]:
        return {**super().exposed(), "advantage_kwargs": self.params}


@dataclass
class CriticAdvantage(Advantage):
    """:class:`Advantage` with GAE by default, and shorthands for its parameters (PPO's).

    Args:
        advantage_estimator: ``"gae"`` by default; any entry of ``ADVANTAGES`` (a critic is
            trained either way).
        gamma, lam: GAE's discount and trace decay (shorthands for the estimator's parameters).
        kl_in_reward_coef: subtract ``coef * KL(policy || ref)`` (k1, per token) from the token
            rewards, InstructGPT style; needs a reference model, so it builds one (a shorthand for
            the estimator's ``kl_in_reward_coef``).
    """

    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    kl_in_reward_coef: float = 0.0

    shorthands: ClassVar[dict[str, tuple[str, Any]]] = {
        "gamma": ("gamma", 1.0), "lam": ("lam", 0.95), "kl_in_reward_coef": ("kl_in_reward_coef", 0.0),
        "norm_adv_by_std": ("norm_by_std", True)}
