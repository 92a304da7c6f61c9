"""GRPO (and its relatives: Dr. GRPO, DAPO's loss settings, RLOO, REINFORCE++, GSPO, CISPO, SAPO,
DPPO, Clip-/KL-Cov) as an ``RLModule`` subclass: the loss and the advantage estimator are registry
entries chosen by name (:data:`~rltrainer.algorithms.POLICY_LOSSES`,
:data:`~rltrainer.algorithms.ADVANTAGES`). The whole of DAPO, dynamic sampling included, is
:class:`~rltrainer.DAPO`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rltrainer.algorithms import (ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, AdvantageContext,
                                  LossContext, aggregate, check_advantage, check_policy_loss, kl_penalty,
                                  required_fields)
from rltrainer.algorithms.advantages import check_group_size, group_signal_metrics
from rltrainer.algorithms.aggregation import masked_sum_over
from rltrainer.algorithms.distill import Teacher, check_same_vocabulary, check_teacher_vocab, distillation_term
from rltrainer.algorithms.rollout_corr import (ROLLOUT_CORRECTIONS, check_rollout_correction, mismatch_metrics,
                                               rejects, share_of_batch)
from rltrainer.data.batch import RolloutBatch
from rltrainer.envs import as_multi_turn, env_reward
from rltrainer.models import ModelSpec, build_causal_lm, freeze, frozen_copy, response_log_probs
from rltrainer.module import RLModule
from rltrainer.optim import adamw
from rltrainer.registry import entry_params
from rltrainer.rewards.manager import declares_correctness, reward_max_score
from rltrainer.rewards.model import RewardSpec, build_reward_model, sequence_scores, split_rewards
from rltrainer.rollout.engine import RolloutEngine, SamplingParams
from rltrainer.schedulers import build_lr_scheduler, check_lr_scheduler

#: Non-tensor fields made by the rollout, not dataset columns; not passed to reward functions.
ROLLOUT_FIELDS = frozenset({"prompt_ids", "response_text", "uid", "finish_reason", "baseline_response_text",
                            "turn_rewards", "env_turns", "env_finish", "env_error"})

#: GRPO's own arguments that set a policy loss's / an estimator's parameter, with their defaults.
LOSS_ARGUMENTS = {"clip_ratio_low": ("clip_ratio_low", 0.2), "clip_ratio_high": ("clip_ratio_high", 0.2),
                  "clip_ratio_c": ("clip_ratio_c", 3.0)}
ADVANTAGE_ARGUMENTS = {"norm_adv_by_std": ("norm_by_std", True)}


def required_stages(moves: bool, needs_old: bool, needs_ref: bool, needs_values: bool, teacher: bool = False,
                    reward_model: bool = False) -> list[str]:
    """The forward passes before ``advantage_step``, in order: ``old_log_prob`` (the policy moves
    within a batch, or something needs the old log-probs on the controller: a teacher does),
    ``ref``, ``teacher``, ``reward_model``, ``values``."""
    return ((["old_log_prob"] if moves or needs_old or teacher else []) + (["ref"] if needs_ref else [])
            + (["teacher"] if teacher else []) + (["reward_model"] if reward_model else [])
            + (["values"] if needs_values else []))


class GRPO(RLModule):
    """Group Relative Policy Optimization (Shao et al. 2024) with the knobs of its successors.

    Args:
        model: hub id or local path, a transformers ``PretrainedConfig`` (random init), or a
            callable returning a causal LM.
        tokenizer: the transformers tokenizer of ``model``.
        reward_funcs: a callable ``fn(completions, **dataset_fields) -> list[float]``, a
            registered name (``"gsm8k"``, ``"math"``, ...), a
            :class:`~rltrainer.rewards.model.RewardModel` (a sequence-classification model scored on
            the training ranks, at most one), or a list of those. ``None`` or ``[]``: no reward,
            which needs a ``teacher`` (distillation alone).
        reward_weights: one weight per entry of ``reward_funcs`` (default 1.0 each).
        reward_num_workers: run the synchronous reward functions in this many processes (``0``: one
            after another on the controller); ``async def`` ones are always awaited concurrently.
        reward_timeout: seconds a sample's reward may take (async, or with ``reward_num_workers``);
            past it the sample scores 0 and counts in ``reward/errors``. A reward function may also
            return a list per completion (one value per response token, i.e. per entry of the
            ``completion_ids`` field every reward function receives): ``token_level_scores [N, T]``,
            which the token-level estimators (``reinforce_plus_plus``, ``gae``) use, while outcome
            estimators use its sum.
        num_generations: group size ``G``: samples per prompt.
        max_new_tokens, temperature, top_p, top_k: rollout sampling (``top_k=0`` is off).
        lr, weight_decay, warmup_steps: AdamW, with a linear warm-up over ``warmup_steps`` optimizer
            steps (transformers' schedules: from 0).
        lr_scheduler_type: the LR schedule after the warm-up, a name of transformers'
            ``get_scheduler`` (as TRL's ``lr_scheduler_type``): ``"constant"`` (default),
            ``"linear"`` or ``"cosine"`` decay to 0 over the run (the Trainer's estimate of its
            optimizer steps), ``"cosine_with_min_lr"``, ...
        lr_scheduler_kwargs: that schedule's own arguments (e.g. ``{"min_lr_rate": 0.1}``).
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
        kl_coef: weight of the KL-to-reference loss (0: no reference model is built).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (``"low_var_kl"``).
        entropy_coef: weight of the entropy bonus.
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"`` or
            ``"seq-mean-token-sum-norm"`` (Dr. GRPO).
        norm_adv_by_std: divide advantages by the group std (``False``: Dr. GRPO): a shorthand for
            the estimator's ``norm_by_std``, in the same way as ``clip_ratio_*``.
        advantage_estimator: an entry of :data:`~rltrainer.algorithms.ADVANTAGES` that needs no
            critic: ``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"reinforce"``, ``"opo"``,
            ``"reinforce_plus_plus"``, ``"reinforce_plus_plus_baseline"``, ``"remax"`` (its
            ``rollout_step`` then also generates one greedy response per prompt, and ``reward_step``
            scores it as the baseline); ``"gae"`` needs :class:`~rltrainer.PPO`.
        advantage_kwargs: that entry's parameters (e.g. ``{"kl_in_reward_coef": 0.01}``: a KL
            penalty in the token rewards, which builds a reference model), checked like
            ``policy_loss_kwargs``.
        update_epochs, mini_batch_size: passes over each batch, and rows per optimizer step.
        rollout_correction: correct for off-policy rollouts with an entry of
            :data:`~rltrainer.algorithms.rollout_corr.ROLLOUT_CORRECTIONS` (verl's rollout
            correction): ``"token_tis"``, ``"seq_tis"``, ``"token_rs"``, ``"seq_rs"``, ``"geo_rs"``,
            ``"token_mis"``, ``"seq_mis"``, ``"geo_rs_token_tis"``, ``"icepop"``; ``None``: off.
            ``fit`` refuses one with an engine whose log-probs are not the full softmax at the
            temperature for this sampling (vLLM with ``top_p < 1`` or ``top_k > 0``).
        rollout_correction_kwargs: that entry's parameters (``threshold``, the IS weight cap;
            ``low``, ``high``, the kept range of the ratio ``pi_old / pi_rollout``), overriding its
            defaults. Checked here: an unknown name, parameter or bad value raises.
        model_seed: seed for a randomly initialised ``model`` config.
        teacher: a :class:`~rltrainer.algorithms.distill.Teacher` for on-policy distillation: a
            frozen causal LM sharing the tokenizer, scored on the training ranks (stage
            ``teacher``, ``teacher_log_probs [N, T]``); ``advantage_step`` subtracts
            ``teacher.coef * (old_log_probs - teacher_log_probs)`` from the estimator's advantages,
            per token (the stage ``old_log_prob`` runs for it). ``None``: no distillation.
        environment: multi-turn episodes instead of single responses: a
            :class:`~rltrainer.envs.MultiTurn` (its limits, tool parser, ...), or an environment class
            (:class:`~rltrainer.envs.Environment`), wrapped in ``MultiTurn`` with its defaults. Each row
            is one episode (``G`` per prompt); ``reward_funcs=None`` then scores each with its summed
            environment reward (:func:`~rltrainer.envs.env_reward`). ``max_new_tokens`` is per turn.
        lora: a ``peft.LoraConfig``: train a LoRA adapter on the policy (``peft.get_peft_model``;
            linear layers, default init, the adapter's ``A`` drawn from ``model_seed``), on the
            ``single`` and ``fsdp2`` strategies. The reference model is the policy with its
            adapter disabled (no second copy). Engines that load adapters (``hf``) receive only
            the adapter after the first sync; others receive the merged weights.

    Where the scores come from, in the loop's order: ``reward_step`` (controller) sums the rule
    rewards (``scores [N]``, zeros if there are none); the compute stages then run on the training
    ranks, ``reward_model`` among them (``rm_scores [N]``); ``advantage_step`` (controller) first
    adds ``weight * rm_scores`` to ``scores``, then runs the estimator on the sum, then subtracts the
    distillation term. So ``critic/score/*`` are logged by ``advantage_step`` when a reward model is
    set (by ``reward_step`` otherwise); ``reward_model/score/mean`` is the model's unweighted mean,
    ``distill/reverse_kl/mean`` the token mean of ``log pi_old - log pi_teacher``. Validation
    (``validation_step``, on the controller) scores with the rule rewards only.

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

    #: whether the module trains a critic (its ``values`` pass exists): PPO's does, GRPO's not.
    uses_critic: bool = False

    def __init__(
        self,
        model: ModelSpec,
        tokenizer: Any,
        reward_funcs: RewardSpec | Sequence[RewardSpec] | None,
        reward_weights: Sequence[float] | None = None,
        reward_num_workers: int = 0,
        reward_timeout: float | None = None,
        num_generations: int = 8,
        max_new_tokens: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        lr_scheduler_type: str = "constant",
        lr_scheduler_kwargs: dict[str, Any] | None = None,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float | None = 3.0,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        entropy_coef: float = 0.0,
        loss_agg_mode: str = "token-mean",
        norm_adv_by_std: bool = True,
        advantage_estimator: str = "grpo",
        advantage_kwargs: dict[str, Any] | None = None,
        policy_loss: str = "ppo_clip",
        policy_loss_kwargs: dict[str, Any] | None = None,
        update_epochs: int = 1,
        mini_batch_size: int | None = None,
        rollout_correction: str | None = None,
        rollout_correction_kwargs: dict[str, Any] | None = None,
        model_seed: int | None = 0,
        teacher: Teacher | None = None,
        environment: Any = None,
        lora: Any = None,
    ) -> None:
        super().__init__()
        self.environment = as_multi_turn(environment)
        if self.environment is not None and reward_funcs is None:
            reward_funcs = env_reward  # the episodes' summed environment reward
        if lora is not None:
            from rltrainer.lora import check_lora_config

            check_lora_config(lora)
        self.lora = lora
        AGGREGATIONS.get(loss_agg_mode), KL_ESTIMATORS.get(kl_estimator)  # unknown names raise here
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        if not 0 <= clip_ratio_low < 1 or clip_ratio_high < 0:
            raise ValueError(f"Need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, "
                             f"{clip_ratio_high}")
        if clip_ratio_c is not None and clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 (the dual-clip cap) or None to disable it, got {clip_ratio_c}")
        self.policy_loss = policy_loss
        # the entries themselves travel with the module (pickled to the training ranks), so a loss a
        # user registered in their script is there even where their registration never ran
        self._policy_loss_fn = POLICY_LOSSES.get(policy_loss)
        self._advantage_fn = ADVANTAGES.get(advantage_estimator)
        self.policy_loss_kwargs = check_policy_loss(policy_loss, entry_params(
            "policy loss", policy_loss, POLICY_LOSSES.defaults(policy_loss), policy_loss_kwargs,
            {"clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high, "clip_ratio_c": clip_ratio_c},
            LOSS_ARGUMENTS))
        self.advantage_estimator = advantage_estimator
        self.advantage_kwargs = check_advantage(advantage_estimator, entry_params(
            "advantage estimator", advantage_estimator, ADVANTAGES.defaults(advantage_estimator), advantage_kwargs,
            {"norm_adv_by_std": norm_adv_by_std}, ADVANTAGE_ARGUMENTS))
        self._advantage_fields = required_fields(advantage_estimator, self.advantage_kwargs)
        check_group_size(advantage_estimator, num_generations)
        if "values" in self._advantage_fields and not self.uses_critic:
            critic_free = [n for n in ADVANTAGES if "values" not in required_fields(n, ADVANTAGES.defaults(n))]
            raise ValueError(f"advantage_estimator={advantage_estimator!r} needs a critic's values [N, T], and "
                             f"{type(self).__name__} trains no critic. Use rltrainer.PPO (a critic trained alongside "
                             f"the policy), or a critic-free estimator: {', '.join(critic_free)}.")
        if rollout_correction is None and rollout_correction_kwargs:
            raise ValueError(f"rollout_correction_kwargs={rollout_correction_kwargs!r} given without "
                             f"rollout_correction; name one of {', '.join(ROLLOUT_CORRECTIONS.names())}.")
        if rollout_correction is not None:  # an unknown name, parameter or value raises here
            check_rollout_correction(rollout_correction, dict(rollout_correction_kwargs or {}))
        if tokenizer is None or getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("GRPO needs a tokenizer with a pad_token_id (set tokenizer.pad_token).")
        self.rewards, self.reward_model_spec, self.reward_model_weight = split_rewards(
            reward_funcs, reward_weights, num_workers=reward_num_workers, timeout=reward_timeout)
        if self.rewards is not None:  # validation's full credit: every rule reward's max_score, weighted
            self.max_score = self.rewards.max_score
        if self.environment is not None and "reward_baselines" in self._advantage_fields:
            raise ValueError(f"advantage_estimator={advantage_estimator!r} scores one greedy single-turn response per "
                             "prompt as its baseline, which an environment's episodes do not have. Use another "
                             "estimator with environment=..., e.g. 'grpo' or 'rloo'.")
        self.distill = self._checked_teacher(teacher, tokenizer)
        self.model_spec = model
        self.model_seed = model_seed
        self.tokenizer = tokenizer
        self.sampling = SamplingParams(n=num_generations, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k)
        check_lr_scheduler(lr_scheduler_type, warmup_steps)
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.lr_scheduler_type, self.lr_scheduler_kwargs = lr_scheduler_type, dict(lr_scheduler_kwargs or {})
        self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = clip_ratio_low, clip_ratio_high, clip_ratio_c
        self.kl_coef, self.kl_estimator, self.entropy_coef = kl_coef, kl_estimator, entropy_coef
        self.loss_agg_mode, self.norm_adv_by_std = loss_agg_mode, norm_adv_by_std
        self.update_epochs, self.mini_batch_size = update_epochs, mini_batch_size
        self.rollout_correction = rollout_correction
        self.rollout_correction_kwargs = dict(rollout_correction_kwargs or {})
        self._correction_rejects = rollout_correction is not None and rejects(rollout_correction,
                                                                               self.rollout_correction_kwargs)

    def _checked_teacher(self, teacher: Teacher | None, tokenizer: Any) -> Teacher | None:
        """``teacher`` after the checks that need no model; and a run needs some training signal."""
        if teacher is not None and not isinstance(teacher, Teacher):
            raise TypeError(f"teacher must be a rltrainer.algorithms.distill.Teacher (the model and its coef), got "
                            f"{type(teacher).__name__}; e.g. teacher=Teacher('Qwen/Qwen3-8B', coef=1.0).")
        if teacher is not None:
            check_same_vocabulary(tokenizer, teacher.tokenizer)
        if self.rewards is None and self.reward_model_spec is None and teacher is None:
            raise ValueError(f"{type(self).__name__} got no reward (reward_funcs is empty) and no teacher: give reward "
                             "functions, a RewardModel, or teacher=Teacher(...) to train on distillation alone.")
        if "reward_baselines" in self._advantage_fields and (self.rewards is None or self.reward_model_spec):
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r} scores a greedy baseline response "
                             "with the rule rewards on the controller; it needs rule rewards and no RewardModel (the "
                             "baseline has no tokens on the training ranks). Use another estimator, e.g. 'grpo'.")
        return teacher

    # -- models ---------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """The policy; a frozen copy as reference if :meth:`needs_ref`; the frozen ``teacher`` and
        ``reward_model`` if given (built like the policy, so strategies place them alike)."""
        self.policy = build_causal_lm(self.model_spec, seed=self.model_seed)
        if self.lora is not None:  # the reference is the policy with its adapter disabled: no copy
            from rltrainer.lora import apply_lora

            self.policy = apply_lora(self.policy, self.lora, seed=self.model_seed or 0)
        self.ref_policy = frozen_copy(self.policy) if self.needs_ref() and self.lora is None else None
        self.teacher = None
        if self.distill is not None:
            self.teacher = freeze(build_causal_lm(self.distill.model, seed=self.distill.seed))
            check_teacher_vocab(self.policy, self.teacher, self.tokenizer, self.distill.tokenizer is not None)
        self.reward_model = None
        if self.reward_model_spec is not None:
            self.reward_model = build_reward_model(self.reward_model_spec.model, self.tokenizer.pad_token_id,
                                                   seed=self.reward_model_spec.seed)

    def needs_ref(self) -> bool:
        """A reference model for the KL loss (``kl_coef > 0``) or the estimator (a KL in the reward)."""
        return self.kl_coef > 0 or "ref_log_probs" in self._advantage_fields

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = adamw(params, lr=self.lr, weight_decay=self.weight_decay)
        sched = build_lr_scheduler(opt, self.lr_scheduler_type, self.warmup_steps, self.estimated_optimizer_steps,
                                   self.lr_scheduler_kwargs)
        return {"optimizer": opt, "lr_scheduler": sched}

    # -- control flow ---------------------------------------------------------------------------
    def rollout_step(self, batch: RolloutBatch, engine: RolloutEngine) -> RolloutBatch:
        """The default sampling; with an estimator that needs a greedy baseline (ReMax: it requires
        ``reward_baselines``), also one greedy response per prompt, ``baseline_response_text`` (each
        row its prompt's), which :meth:`reward_step` scores."""
        out = super().rollout_step(batch, engine)
        if "reward_baselines" in self._advantage_fields:
            greedy_sampling = dataclasses.replace(self.sampling, n=1, temperature=0.0)
            greedy = engine.generate(list(batch["prompt_ids"]), greedy_sampling)  # B greedy responses
            out["baseline_response_text"] = [text for text in greedy.text for _ in range(self.sampling.n)]
        return out

    def reward_step(self, batch: RolloutBatch) -> RolloutBatch:
        """``scores [N]``: the rule rewards' weighted sum (zeros without rule rewards). A reward
        model's scores are added later, by :meth:`add_reward_model_scores` (see the class docstring)."""
        if self.rewards is None:
            batch["scores"] = torch.zeros(len(batch), dtype=torch.float32)  # [N]
        else:
            fields = {k: list(v) for k, v in batch.non_tensors.items() if k not in ROLLOUT_FIELDS}
            if "responses" in batch:  # the completions' token ids, TRL's name
                with_ids = {**fields, "completion_ids": [row[mask.bool()].tolist() for row, mask in
                                                        zip(batch["responses"], batch["response_mask"])]}
            else:  # a batch made by hand, without token ids
                with_ids = fields
            result = self.rewards(list(batch["response_text"]), with_ids)
            batch["scores"] = result.scores  # [N]
            if result.token_scores is not None:  # per-token rewards; their rows sum to the scores
                batch["token_level_scores"] = result.token_level_scores(batch["response_mask"])  # [N, T]
            batch["reward_components"] = torch.stack(list(result.per_func.values()), dim=-1)  # [N, F], unweighted
            batch.meta["reward_components"] = list(result.per_func)  # the F names
            if result.invalid is not None:  # NaN/inf from a reward function: out of the advantages
                batch["reward_invalid"] = result.invalid  # [N] bool
            if "baseline_response_text" in batch:
                batch["reward_baselines"] = self.baseline_scores(batch, fields)  # [N]
                self.log("critic/reward_baseline/mean", batch["reward_baselines"].mean().item())
            for name, value in result.metrics().items():
                self.log(name, value)
        if self.reward_model_spec is None:
            self.log_scores(batch["scores"])
        return batch

    def teardown(self) -> None:
        """Stop the reward worker processes (``reward_num_workers``); a later reward call starts them again."""
        if self.rewards is not None:
            self.rewards.close()

    def correct_rows(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``[N]`` bool: rows where every rule reward that declares ``correctness`` (``gsm8k``,
        ``math``) gave its ``max_score``, from ``reward_components``; ``None`` if none declares it."""
        if self.rewards is None or "reward_components" not in batch:
            return None
        judges = [(i, reward_max_score(fn)) for i, fn in enumerate(self.rewards.reward_funcs)
                  if declares_correctness(fn)]
        if not judges:
            return None
        components = batch["reward_components"]  # [N, F], unweighted
        return torch.stack([components[:, i] >= top - 1e-6 for i, top in judges], dim=-1).all(-1)  # [N]

    def log_scores(self, scores: torch.Tensor) -> None:
        """``critic/score/{mean,max,min}`` of the scores the estimator sees (``[N]``)."""
        for stat in ("mean", "max", "min"):
            self.log(f"critic/score/{stat}", getattr(scores, stat)().item())

    def add_reward_model_scores(self, batch: RolloutBatch) -> RolloutBatch:
        """``scores += weight * rm_scores`` (the stage ``reward_model``'s ``[N]``), logged (controller,
        first in :meth:`advantage_step`). Without a reward model, the batch as it is."""
        if self.reward_model_spec is None:
            return batch
        if "rm_scores" not in batch:
            raise KeyError(f"A RewardModel is set, so advantage_step needs 'rm_scores' [N] from the compute stage "
                           f"'reward_model' (compute_stages adds it); the batch has {batch.keys()}")
        rm_scores = batch["rm_scores"].float()  # [N]
        batch["scores"] = batch["scores"] + self.reward_model_weight * rm_scores  # [N]
        self.log("reward_model/score/mean", rm_scores.mean().item())
        self.log(f"reward/{self.reward_model_spec.name}/mean", rm_scores.mean().item())
        self.log_scores(batch["scores"])
        return batch

    def baseline_scores(self, batch: RolloutBatch, fields: dict[str, list[Any]]) -> torch.Tensor:
        """``reward_baselines [N]``: the reward of each group's greedy response, scored once per group."""
        uids = list(batch["uid"])
        first: dict[Any, int] = {}
        for i, uid in enumerate(uids):
            first.setdefault(uid, i)
        rows = list(first.values())
        texts = [batch["baseline_response_text"][i] for i in rows]
        scores = self.rewards(texts, {k: [v[i] for i in rows] for k, v in fields.items()}).scores  # [groups]
        position = {uid: k for k, uid in enumerate(first)}
        return scores[torch.tensor([position[uid] for uid in uids])]

    def compute_stages(self) -> list[str]:
        """``old_log_prob`` if the policy moves within a batch (``update_epochs > 1`` or
        ``mini_batch_size`` set), the rollouts need correcting (:meth:`corrects_rollouts`) with a
        correction that rejects tokens, the estimator needs them (a KL in the reward) or the loss
        selects tokens from the whole batch (a ``prepare``: Clip-Cov, KL-Cov); otherwise the old
        log-probs equal the current ones at the update's forward and ``policy_step`` uses those,
        detached. ``ref`` if :meth:`needs_ref`; ``values`` if the module trains a critic."""
        needs_old = ((self.corrects_rollouts() and self._correction_rejects) or self._loss_prepare() is not None
                     or "old_log_probs" in self._advantage_fields)
        return required_stages(moves=self.update_epochs > 1 or self.mini_batch_size is not None,
                               needs_old=needs_old, needs_ref=self.needs_ref(), needs_values=self.uses_critic,
                               teacher=self.distill is not None, reward_model=self.reward_model_spec is not None)

    def compute_step(self, micro_batch: RolloutBatch, stage: str) -> dict[str, torch.Tensor]:
        """RLModule's stages, plus ``teacher`` (``teacher_log_probs [n, T]``, at the sampling
        temperature, as the policy's) and ``reward_model`` (``rm_scores [n]``)."""
        if stage == "teacher":
            temperature = micro_batch.meta.get("temperature") or 1.0
            return {"teacher_log_probs": response_log_probs(self.teacher, micro_batch, temperature)[0]}
        if stage == "reward_model":
            return {"rm_scores": sequence_scores(self.reward_model, micro_batch)}
        if stage == "ref" and self.lora is not None:
            from rltrainer.lora import adapter_disabled

            with adapter_disabled(self.policy):
                temperature = micro_batch.meta.get("temperature") or 1.0
                return {"ref_log_probs": response_log_probs(self.policy, micro_batch, temperature)[0]}
        return super().compute_step(micro_batch, stage)

    def _loss_prepare(self) -> Callable[..., dict[str, torch.Tensor]] | None:
        return getattr(self._policy_loss_fn, "prepare", None)

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
        """Correct the rollouts, then the estimator (by name, with its parameters), then the loss's
        batch-level ``prepare`` if it has one (its outputs travel in the batch, named in
        ``meta["loss_extras"]``)."""
        batch = self.correct_rollouts(self.add_reward_model_scores(batch))
        missing = sorted(f for f in self._advantage_fields if f not in batch)
        if missing:
            raise KeyError(f"advantage_estimator={self.advantage_estimator!r} needs {missing} in the batch (the "
                           f"stages of compute_stages and GRPO's rollout/reward steps add them); it has {batch.keys()}")
        advantages, returns = self.estimate_advantages(batch)
        advantages = self.distill_advantages(batch, advantages)
        batch["advantages"] = advantages  # [N, T]
        batch["returns"] = returns  # [N, T]
        mask = batch["response_mask"].bool()
        if self.advantage_kwargs.get("kl_in_reward_coef"):
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.advantage_kwargs["kl_estimator"])
            self.log("critic/kl_in_reward", kl[mask].mean().item() if mask.any() else 0.0)
        prepare = self._loss_prepare()
        if prepare is not None:
            extras = prepare(batch["old_log_probs"], advantages, batch["response_mask"], **self.policy_loss_kwargs)
            for name, value in extras.items():
                batch[name] = value  # [N, T]
            batch.meta["loss_extras"] = sorted(extras)
        self.log("critic/advantages/mean", advantages[mask].mean().item() if mask.any() else 0.0)
        signal = group_signal_metrics(batch["scores"], batch["uid"], batch["responses"], batch["response_mask"])
        for name, value in signal.items():  # a stalled run shows here: all groups zero-std
            self.log(name, value)
        return batch

    def estimate_advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator's ``(advantages, returns)`` ``[N, T]``. Rows in ``reward_invalid [N]`` (a
        reward function scored them NaN or inf) are left out: the estimator runs on the other rows
        (so they do not move a group's mean or std), and these get advantage 0 and leave
        ``response_mask`` (no loss term, no token in any count)."""
        invalid = batch["reward_invalid"] if "reward_invalid" in batch else None
        if invalid is None or not invalid.any():
            return self._run_estimator(batch)
        keep = (~invalid).nonzero().flatten()  # [N'] rows with finite rewards
        mask = batch["response_mask"]
        advantages = torch.zeros(mask.shape, dtype=torch.float32)  # [N, T]
        returns = torch.zeros(mask.shape, dtype=torch.float32)  # [N, T]
        if len(keep):
            kept_advantages, kept_returns = self._run_estimator(batch[keep])
            advantages[keep], returns[keep] = kept_advantages.float(), kept_returns.float()
        batch["response_mask"] = mask * (~invalid).to(mask.dtype).unsqueeze(-1)  # [N, T]
        return advantages, returns

    def _run_estimator(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = AdvantageContext(**{f: batch[f] for f in self._advantage_fields},
                               token_level_scores=batch.get("token_level_scores"))
        return self._advantage_fn(batch["scores"], batch["response_mask"], batch["uid"], ctx, **self.advantage_kwargs)

    def distill_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        """``advantages [N, T] - coef * (old_log_probs - teacher_log_probs)`` with a teacher (logs
        ``distill/reverse_kl/mean``); the advantages as they are without one."""
        if self.distill is None:
            return advantages
        missing = [f for f in ("old_log_probs", "teacher_log_probs") if f not in batch]
        if missing:
            raise KeyError(f"Distillation needs {missing} [N, T] from the compute stages 'old_log_prob' and 'teacher' "
                           f"(compute_stages adds them with a teacher); the batch has {batch.keys()}")
        term, reverse_kl = distillation_term(batch["old_log_probs"], batch["teacher_log_probs"],
                                             batch["response_mask"], self.distill.coef)
        self.log("distill/reverse_kl/mean", reverse_kl)
        return advantages - term  # [N, T]

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
        ctx = LossContext(self.loss_agg_mode, **counts, rollout_is_weights=is_weights,
                          extras={k: mb[k] for k in meta.get("loss_extras", ())})
        pg_loss, metrics = self._policy_loss_fn(log_probs, old_log_probs, mb["advantages"], mask, ctx,
                                                **self.policy_loss_kwargs)
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
