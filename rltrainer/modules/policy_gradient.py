"""``PolicyGradient``: an ``RLModule`` composed of parts (a policy loss, an advantage estimator, a
rollout correction, a KL penalty, and optional ones: a critic, a teacher, a reward model), each
declaring the forward passes it needs and the fields it reads and adds (:mod:`rltrainer.algorithms.parts`).
The hooks ask the parts in order; the presets (GRPO, PPO, DAPO, ...: :mod:`rltrainer.modules`) say
which parts, with which defaults."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from rltrainer.algorithms.advantages import group_signal_metrics
from rltrainer.algorithms.distill import Teacher
from rltrainer.algorithms.part import STAGE_FIELDS, BaseModels, Part, Sampler, Setup, Step, Update, check_reads
from rltrainer.algorithms.parts import (Advantage, KLPenalty, PolicyLoss, RewardModelScores, RolloutCorrection, Routing,
                                        log_scores)
from rltrainer.data.batch import RolloutBatch
from rltrainer.envs import as_multi_turn, env_reward
from rltrainer.lora import adapter_disabled, apply_lora, check_lora_config
from rltrainer.models import ModelSpec, build_causal_lm, frozen_copy, response_log_probs
from rltrainer.models.moe import recording
from rltrainer.module import RLModule
from rltrainer.modules.settings import Optimizer, Rewards, flat_keywords, route_settings
from rltrainer.rewards.manager import declares_correctness, reward_max_score
from rltrainer.rewards.model import RewardSpec, split_rewards
from rltrainer.rollout.engine import RolloutEngine, SamplingParams
from rltrainer.values import check_int

#: Non-tensor fields made by the rollout, not dataset columns; not passed to reward functions.
ROLLOUT_FIELDS = frozenset({"prompt_ids", "response_text", "uid", "finish_reason", "baseline_response_text",
                            "turn_rewards", "env_turns", "env_finish", "env_error"})
#: ``num_generations`` (``G``) where a preset does not set it
GROUP_SIZE = 8


class PolicyGradient(RLModule):
    """A policy-gradient algorithm composed of parts; the presets (:class:`~rltrainer.GRPO`,
    :class:`~rltrainer.PPO`, :class:`~rltrainer.DAPO`, ...) are this with other parts or defaults.

    Args:
        model: hub id or local path, a transformers ``PretrainedConfig`` (random init), or a
            callable returning a causal LM.
        tokenizer: the transformers tokenizer of ``model``.
        reward_funcs: a callable ``fn(completions, **dataset_fields) -> list[float]``, a registered
            name (``"gsm8k"``, ``"math"``, ...), a :class:`~rltrainer.rewards.model.RewardModel` (a
            sequence-classification model scored on the training ranks, at most one), or a list of
            those. ``None`` or ``[]``: no reward, which needs a ``teacher`` (distillation alone). A
            reward function may also return a list per completion (one value per response token,
            i.e. per entry of the ``completion_ids`` field every reward function receives):
            ``token_level_scores [N, T]``, which the token-level estimators use, while outcome
            estimators use its sum.
        num_generations: group size ``G``: samples per prompt (``None``: the preset's, its
            ``preset["num_generations"]``: 8; DAPO 16, PPO 1).
        max_new_tokens, temperature, top_p, top_k: rollout sampling (``top_k=0`` is off).
        update_epochs, mini_batch_size: passes over each batch, and rows per optimizer step.
        model_seed: seed for a randomly initialised ``model`` config.
        teacher: a :class:`~rltrainer.algorithms.distill.Teacher` (the distillation part).
        environment: multi-turn episodes instead of single responses: a
            :class:`~rltrainer.envs.MultiTurn`, or an environment class, wrapped in ``MultiTurn``
            with its defaults. Each row is one episode (``G`` per prompt); ``reward_funcs=None``
            then scores each with its summed environment reward. ``max_new_tokens`` is per turn.
        lora: a ``peft.LoraConfig``: train a LoRA adapter on the policy (``single`` and ``fsdp2``
            strategies); the reference model is the policy with its adapter disabled.
        optimizer, rewards: the settings groups, given whole
            (:class:`~rltrainer.modules.settings.Optimizer`, :class:`~rltrainer.modules.settings.Rewards`).
        parts: parts given as such (:class:`~rltrainer.algorithms.parts.PolicyLoss`,
            ``Advantage``, ``RolloutCorrection``, ``KLPenalty``, ``Critic``, ``Routing``, a part of
            your own...); each replaces the preset's part of its ``kind``, preset defaults and all.
            A part not given is built from the preset's defaults and the flat settings.
        **settings: the same settings flat, by one mapping
            (:func:`~rltrainer.modules.settings.flat_keywords`): a keyword is the field of the one
            part or group that declares it (``clip_ratio_high=0.28`` goes to ``PolicyLoss``,
            ``lr=...`` to ``Optimizer``, ``reward_weights=...`` to ``Rewards``); an unknown name
            raises a TypeError. :meth:`flat_settings` reads them back from their owners.

    Where the scores come from, in the loop's order: ``reward_step`` (controller) sums the rule
    rewards (``scores [N]``, zeros if there are none); the compute stages then run on the training
    ranks, ``reward_model`` among them (``rm_scores [N]``); ``advantage_step`` (controller) asks
    the parts in order: the reward model's scores join ``scores``, the rollouts are corrected, the
    estimator runs, the distillation term is subtracted, the loss prepares its batch-level
    selection. Validation (``validation_step``, on the controller) scores with the rule rewards only.
    """

    #: the part kinds in the order they are asked, with the class built from settings (None: optional)
    PARTS: ClassVar[dict[str, type[Part] | None]] = {
        "correction": RolloutCorrection, "advantage": Advantage, "loss": PolicyLoss, "kl": KLPenalty, "critic": None,
        "routing": Routing}
    #: settings groups that are not parts of the algorithm
    GROUPS: ClassVar[dict[str, type]] = {"rewards": Rewards, "optimizer": Optimizer}
    #: a preset's defaults: for routed settings (e.g. ``{"policy_loss": "gspo"}``) and ``num_generations``
    preset: ClassVar[dict[str, Any]] = {}

    def __init__(self, model: ModelSpec, tokenizer: Any, reward_funcs: Sequence[RewardSpec] | RewardSpec | None, *,
                 num_generations: int | None = None, max_new_tokens: int = 512, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, update_epochs: int = 1, mini_batch_size: int | None = None,
                 model_seed: int | None = 0, teacher: Teacher | None = None, environment: Any = None,
                 lora: Any = None, optimizer: Optimizer | None = None, rewards: Rewards | None = None,
                 parts: Sequence[Part] = (), **settings: Any) -> None:
        super().__init__()
        owner = type(self).__name__
        given = {"optimizer": optimizer, "rewards": rewards, **given_parts(owner, parts, self.PARTS)}
        named = [p for p in inspect.signature(PolicyGradient.__init__).parameters if p != "self"]
        preset = {k: v for k, v in self.preset.items() if k != "num_generations"}
        built = route_settings(owner, settings, {**self.GROUPS, **self.PARTS}, given, preset, named)
        self.environment = as_multi_turn(environment)
        if self.environment is not None and reward_funcs is None:
            reward_funcs = env_reward  # the episodes' summed environment reward
        if lora is not None:
            check_lora_config(lora)
        self.lora = lora
        if num_generations is None:
            num_generations = self.preset.get("num_generations", GROUP_SIZE)
        num_generations = check_int("num_generations", num_generations, at_least=1, meaning="samples per prompt, G",
                                    owner=owner)
        update_epochs = check_int("update_epochs", update_epochs, at_least=1, meaning="passes over each batch",
                                  owner=owner)
        mini_batch_size = check_int("mini_batch_size", mini_batch_size, at_least=1, none="the whole batch",
                                    meaning="rows per optimizer step", owner=owner)
        model_seed = check_int("model_seed", model_seed, none="unseeded", owner=owner)
        if teacher is not None and not isinstance(teacher, Teacher):
            raise TypeError(f"teacher must be a rltrainer.algorithms.distill.Teacher (the model and its coef), got "
                            f"{type(teacher).__name__}; e.g. teacher=Teacher('Qwen/Qwen3-8B', coef=1.0).")
        if tokenizer is None or getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(f"{owner} needs a tokenizer with a pad_token_id (set tokenizer.pad_token).")
        self.reward_settings: Rewards = built.pop("rewards")
        self.rewards, self.reward_model_spec, self.reward_model_weight = split_rewards(
            reward_funcs, self.reward_settings.reward_weights, num_workers=self.reward_settings.reward_num_workers,
            timeout=self.reward_settings.reward_timeout)
        if self.rewards is not None:  # validation's full credit: every rule reward's max_score, weighted
            self.max_score = self.rewards.max_score
        self.optimizer_settings: Optimizer = built.pop("optimizer")
        reward_model = (RewardModelScores(self.reward_model_spec, self.reward_model_weight)
                        if self.reward_model_spec is not None else None)
        #: the parts, in the order every hook asks them; each holds its settings (read them there)
        self.parts: dict[str, Part] = {k: v for k, v in {"teacher": teacher, "reward_model": reward_model,
                                                          **built}.items() if v is not None}
        self.distill = teacher
        self.model_spec, self.model_seed, self.tokenizer = model, model_seed, tokenizer
        self.sampling = SamplingParams(n=num_generations, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k)
        self.update_epochs, self.mini_batch_size = update_epochs, mini_batch_size
        self._check_parts(num_generations)

    def _check_parts(self, num_generations: int) -> None:
        """Each part's own check, then the graph of what the parts read and add
        (:func:`~rltrainer.algorithms.part.check_reads`); the pipelines the parts allow."""
        owner = type(self).__name__
        stages = frozenset(s for part in self.parts.values() for flag in (False, True) for s in part.stages(flag))
        setup = Setup(owner, num_generations, stages, self.environment is not None, self.rewards is not None,
                      self.reward_model_spec is not None, self.tokenizer, self.sampling.max_new_tokens)
        for part in self.parts.values():
            part.check(setup)
        if self.rewards is None and self.reward_model_spec is None and self.distill is None:
            raise ValueError(f"{owner} got no reward (reward_funcs is empty) and no teacher: give reward "
                             "functions, a RewardModel, or teacher=Teacher(...) to train on distillation alone.")
        check_reads(owner, self.parts, stages | {"old_log_prob"})
        for part in self.parts.values():
            if part.pipelines() is not None:
                self.supported_pipelines, self.pipeline_reason = part.pipelines(), part.pipeline_reason

    @classmethod
    def default_of(cls, name: str) -> Any:
        """The default of keyword ``name`` here: the preset's, else a named argument's, else the field
        default of the part or group that declares it (:func:`~rltrainer.modules.settings.flat_keywords`)."""
        if name in cls.preset:
            return cls.preset[name]
        named = inspect.signature(cls).parameters
        if name in named and named[name].kind is not named[name].VAR_KEYWORD:
            return GROUP_SIZE if name == "num_generations" else named[name].default
        groups = {**cls.GROUPS, **cls.PARTS}
        kind = flat_keywords(groups).get(name)
        if kind is None:
            raise KeyError(f"{cls.__name__} has no argument or setting {name!r}")
        return next(f.default for f in dataclasses.fields(groups[kind]) if f.name == name)

    def flat_settings(self) -> dict[str, Any]:
        """Every setting by its flat keyword, read from the part or group that holds it (the
        ``*_kwargs``: the registry entry's full parameters); the loggers' hyperparameters."""
        groups = [self.reward_settings, self.optimizer_settings, *(p for k, p in self.parts.items() if k in self.PARTS)]
        return {name: value for group in groups for name, value in group.exposed().items()}

    # -- models ---------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """The policy (with its LoRA adapter); a frozen copy as reference if :meth:`needs_ref`; then
        each part's models (the teacher, the reward model, the critic), built like the policy so
        every strategy places them alike."""
        self.policy = build_causal_lm(self.model_spec, seed=self.model_seed)
        if self.lora is not None:  # the reference is the policy with its adapter disabled: no copy
            self.policy = apply_lora(self.policy, self.lora, seed=self.model_seed or 0)
        self.ref_policy = frozen_copy(self.policy) if self.needs_ref() and self.lora is None else None
        self.teacher, self.reward_model = None, None
        base = BaseModels(self.policy, self.tokenizer, self.model_spec, self.model_seed)
        for part in self.parts.values():
            for name, model in part.build_models(base).items():
                setattr(self, name, model)

    def needs_ref(self) -> bool:
        """A reference model: some part asks for the stage ``ref`` (a KL loss, a KL in the reward)."""
        return any("ref" in part.stages(False) for part in self.parts.values())

    def configure_optimizers(self) -> dict[str, Any] | list[dict[str, Any]]:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        policy = self.optimizer_settings.build(params, self.estimated_optimizer_steps)
        models = dict(self.named_children())
        decay = self.optimizer_settings.weight_decay
        others = [opt for part in self.parts.values() for opt in part.optimizers(models, decay)]
        return [policy, *others] if others else policy

    # -- control flow ---------------------------------------------------------------------------
    def reads(self, field: str) -> bool:
        """Whether some part reads ``field`` (its estimator's context included)."""
        return any(field in part.fields_read() for part in self.parts.values())

    def rollout_step(self, batch: RolloutBatch, engine: RolloutEngine) -> RolloutBatch:
        """The first part's rollout that has one (DAPO's group filter: rows sampled, scored and
        filtered, drawing more prompts), else :meth:`default_rollout`."""
        sampler = Sampler(lambda prompts: self.score(self.default_rollout(prompts, engine)),
                          self.draw_prompts if self._prompt_source is not None else None,  # by hand: draws none
                          self.sampling.n, self.tokenizer.pad_token_id)
        step = self.controller_step()
        for part in self.parts.values():
            rows = part.rollout(batch, sampler, step)
            if rows is not None:
                return rows
        return self.default_rollout(batch, engine)

    def default_rollout(self, batch: RolloutBatch, engine: RolloutEngine) -> RolloutBatch:
        """RLModule's sampling; when a part reads ``reward_baselines`` (ReMax), also one greedy
        response per prompt, ``baseline_response_text`` (each row its prompt's), which
        :meth:`score` scores."""
        out = super().rollout_step(batch, engine)
        if self.reads("reward_baselines"):
            greedy_sampling = dataclasses.replace(self.sampling, n=1, temperature=0.0)
            greedy = engine.generate(list(batch["prompt_ids"]), greedy_sampling)  # B greedy responses
            out["baseline_response_text"] = [text for text in greedy.text for _ in range(self.sampling.n)]
        return out

    def reward_step(self, batch: RolloutBatch) -> RolloutBatch:
        """:meth:`score`, unless a part's rollout scored the rows already (they have ``scores``),
        then ``critic/score/*`` (without a reward model, whose scores join in :meth:`advantage_step`)."""
        if "scores" not in batch:
            batch = self.score(batch)
        if self.reward_model_spec is None:
            self.log_scores(batch["scores"])
        return batch

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """``scores [N]``: the rule rewards' weighted sum (zeros without rule rewards), then each
        part's shaping (DAPO's overlong penalty). A reward model's scores are added later, in
        :meth:`advantage_step` (see the class docstring)."""
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
            batch.reward_components = list(result.per_func)  # the F names
            if result.invalid is not None:  # NaN/inf from a reward function: out of the advantages
                batch["reward_invalid"] = result.invalid  # [N] bool
            if "baseline_response_text" in batch:
                batch["reward_baselines"] = self.baseline_scores(batch, fields)  # [N]
                self.log("critic/reward_baseline/mean", batch["reward_baselines"].mean().item())
            for name, value in result.metrics().items():
                self.log(name, value)
        step = self.controller_step()
        for part in self.parts.values():
            batch = part.score(batch, step)
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
        log_scores(scores, self.log)

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
        """The forward passes the parts ask for, in the order of
        :data:`~rltrainer.algorithms.part.STAGE_FIELDS`: ``old_log_prob`` also when the policy moves
        within a batch (``update_epochs > 1`` or ``mini_batch_size`` set); otherwise the old
        log-probs equal the current ones at the update's forward and ``policy_step`` uses those,
        detached."""
        off_policy = self.off_policy()
        wanted = {stage for part in self.parts.values() for stage in part.stages(off_policy)}
        if self.update_epochs > 1 or self.mini_batch_size is not None:
            wanted.add("old_log_prob")
        return [stage for stage in STAGE_FIELDS if stage in wanted]

    def compute_step(self, micro_batch: RolloutBatch, stage: str) -> dict[str, torch.Tensor]:
        """RLModule's stages (``ref`` with a LoRA policy: the policy with its adapter disabled), and
        the parts' (``teacher``, ``reward_model``, ``values``)."""
        if stage == "ref" and self.lora is not None:
            with adapter_disabled(self.policy):
                temperature = micro_batch.temperature or 1.0
                return {"ref_log_probs": response_log_probs(self.policy, micro_batch, temperature,
                                                            **self.route_kwargs(micro_batch))[0]}
        models = dict(self.named_children())
        for part in self.parts.values():
            out = part.compute(models, micro_batch, stage)
            if out is not None:
                return out
        return super().compute_step(micro_batch, stage)

    def records_routes(self) -> bool:
        """The routing part's ``routing_replay`` is ``"rollout"`` or ``"compare"``."""
        return self.parts["routing"].records_routes

    def route_kwargs(self, micro_batch: RolloutBatch) -> dict[str, Any]:
        """The routing part's: the rows' ``routed_experts``, replayed (``"rollout"``) or compared."""
        return self.parts["routing"].route_kwargs(micro_batch)

    def off_policy(self) -> bool:
        """Whether rows are off-policy in this run (an async pipeline, or an engine whose log-probs
        differ), as the Trainer handed it over at setup (:class:`~rltrainer.module.Attachment`)."""
        return self.attached.off_policy

    @property
    def rollout_correction(self) -> str | None:
        """The rollout correction its ``correction`` part applies (``None``: none), which the Trainer
        checks against the engine's log-probs before building anything."""
        return self.parts["correction"].rollout_correction

    def corrects_rollouts(self) -> bool:
        """Whether rollouts can be off-policy here (the Trainer's ``off_policy``) or a
        ``rollout_correction`` is set: then the mismatch is logged and the correction applied."""
        return self.off_policy() or self.parts["correction"].rollout_correction is not None

    def advantage_step(self, batch: RolloutBatch) -> RolloutBatch:
        """Ask the parts in order: before the estimator (a reward model's scores, the rollout
        correction), the estimator, the advantages' adjustments (distillation), then what the update
        needs (the loss's batch-level selection); log the advantages and the group signal."""
        step = self.controller_step()
        for part in self.parts.values():
            batch = part.before_advantages(batch, step)
        advantages, returns = self.estimate_advantages(batch)
        for part in self.parts.values():
            advantages = part.adjust_advantages(batch, advantages, step)
        batch["advantages"] = advantages  # [N, T]
        batch["returns"] = returns  # [N, T]
        for part in self.parts.values():
            batch = part.after_advantages(batch, step)
        mask = batch["response_mask"].bool()
        self.log("critic/advantages/mean", advantages[mask].mean().item() if mask.any() else 0.0)
        signal = group_signal_metrics(batch["scores"], batch["uid"], batch["responses"], batch["response_mask"])
        for name, value in signal.items():  # a stalled run shows here: all groups zero-std
            self.log(name, value)
        return batch

    def controller_step(self) -> Step:
        """The step as the parts' controller hooks see it."""
        return Step(self.log, self.off_policy(), self.sampling.max_new_tokens)

    def estimate_advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The advantage part's ``(advantages, returns)`` ``[N, T]`` (rows with invalid rewards left out)."""
        return self.parts["advantage"].estimate(batch)

    # -- compute flow ---------------------------------------------------------------------------
    def policy_step(self, micro_batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The policy's forward, then each part's term: the correction's IS weights, the policy
        loss with its entropy bonus, the KL penalty, the critic's value loss."""
        loss_part: PolicyLoss = self.parts["loss"]
        temperature = micro_batch.temperature or 1.0
        with recording(self.policy) as routing:  # a MoE policy's routers (None: dense)
            log_probs, entropy = response_log_probs(self.policy, micro_batch, temperature, with_entropy=True,
                                                    entropy_grad=loss_part.entropy_coef != 0,
                                                    **self.route_kwargs(micro_batch))
        old_log_probs = micro_batch["old_log_probs"] if "old_log_probs" in micro_batch else log_probs.detach()
        counts = {"global_tokens": micro_batch.global_tokens, "global_rows": micro_batch.global_rows,
                  "max_response_length": self.sampling.max_new_tokens}
        u = Update(micro_batch, dict(self.named_children()), log_probs, entropy, old_log_probs,
                   loss_part.loss_agg_mode, counts, routing=routing)
        for part in self.parts.values():
            part.update(u)
        assert u.loss is not None, "the policy loss part adds the loss"
        return u.loss, u.metrics



def given_parts(owner: str, parts: Sequence[Part], kinds: dict[str, type[Part] | None]) -> dict[str, Part]:
    """``parts`` by their ``kind``; refuses what is not a part, a kind given twice, and a kind the
    module has no place for (with the kinds it has)."""
    out: dict[str, Part] = {}
    for part in parts:
        if not isinstance(part, Part) or not part.kind:
            raise TypeError(f"{owner}(parts=...) takes parts (rltrainer.algorithms.parts: PolicyLoss, Advantage, "
                            f"KLPenalty, ...), each with a kind; got {part!r}.")
        if part.kind not in kinds:
            raise TypeError(f"{owner}(parts=...) got {type(part).__name__}, of kind {part.kind!r}, which {owner} has "
                            f"no place for; its kinds: {', '.join(kinds)}. Add it to a subclass's PARTS.")
        if part.kind in out:
            raise TypeError(f"{owner}(parts=...) got two parts of kind {part.kind!r}: {out[part.kind]!r} and {part!r}.")
        out[part.kind] = part
    return out
