"""GRPO: :class:`~rltrainer.modules.PolicyGradient` with its default parts. Its relatives (Dr. GRPO,
GSPO, CISPO, RLOO, REINFORCE++) are presets in :mod:`rltrainer.modules.presets`; the whole of DAPO,
dynamic sampling included, is :class:`~rltrainer.DAPO`; PPO, policy gradient with a critic,
:class:`~rltrainer.PPO`."""

from __future__ import annotations

from rltrainer.modules.policy_gradient import ROLLOUT_FIELDS, PolicyGradient

__all__ = ["GRPO", "ROLLOUT_FIELDS"]


class GRPO(PolicyGradient):
    """Group Relative Policy Optimization (Shao et al. 2024) with the knobs of its successors.

    The parts, by kind (each documents its settings; give a part whole, ``GRPO(...,
    parts=[PolicyLoss(clip_ratio_high=0.28)])``, or its settings flat, ``GRPO(...,
    clip_ratio_high=0.28)``: :func:`~rltrainer.modules.settings.flat_keywords` is the mapping):

    - :class:`~rltrainer.algorithms.parts.PolicyLoss` (``loss``): ``policy_loss="ppo_clip"``, the clip range
      ``clip_ratio_low=0.2``, ``clip_ratio_high=0.2``, ``clip_ratio_c=3.0``, ``entropy_coef=0.0``,
      ``loss_agg_mode="token-mean"``;
    - :class:`~rltrainer.algorithms.parts.Advantage` (``advantage``): ``advantage_estimator="grpo"``
      (``norm_adv_by_std=True``); an estimator that needs a critic's values is refused;
    - :class:`~rltrainer.algorithms.parts.RolloutCorrection` (``correction``): ``rollout_correction=None`` (the
      mismatch is logged when rollouts can be off-policy);
    - :class:`~rltrainer.algorithms.parts.KLPenalty` (``kl``): ``kl_coef=0.0`` (no reference model),
      ``kl_estimator="k3"``;
    - optional: a :class:`~rltrainer.algorithms.distill.Teacher` (``teacher=``), a
      :class:`~rltrainer.rewards.model.RewardModel` (in ``reward_funcs``), a
      :class:`~rltrainer.algorithms.parts.Critic` (``parts=[Critic()]``);
    - :class:`~rltrainer.algorithms.parts.Routing` (``routing``): ``routing_replay="rollout"``,
      ``router_aux_loss_coef=None`` (a mixture-of-experts policy's);
    - and the settings groups :class:`~rltrainer.modules.settings.Optimizer` (``optimizer=``:
      ``lr=1e-6``, ``weight_decay``, ``warmup_steps``, ``lr_scheduler_type``,
      ``lr_scheduler_kwargs``) and :class:`~rltrainer.modules.settings.Rewards` (``rewards=``:
      ``reward_weights``, ``reward_num_workers``, ``reward_timeout``).

    The module's own arguments: :class:`~rltrainer.modules.PolicyGradient`.
    """
