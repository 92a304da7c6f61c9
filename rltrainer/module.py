"""``RLModule``: the algorithm, written as hooks. The docstrings below are the specification.

Where each hook runs is fixed:

========================  =========================================  =================================
hook                      runs on                                    called
========================  =========================================  =================================
configure_model           every training rank                        once, before anything else
configure_optimizers      every training rank                        once, after the model is placed
rollout_step              controller (calls the engine)              every step
reward_step               controller                                 every step
compute_step              every training rank, per micro-batch,      every step, before advantages
                          under ``torch.no_grad()``
advantage_step            controller                                 every step
policy_step               every training rank, per micro-batch       every optimizer step
on_before_optimizer_step  every training rank, once per optimizer    every optimizer step, after the
                                                                     backward passes
gradient_clip_norm        every training rank                        every optimizer step, before it
                                                                     clips
validation_step           controller (calls the engine)              every ``val_check_interval``
other on_*                controller                                 at those points of ``fit()``
========================  =========================================  =================================

A module therefore must be picklable, and ``compute_step`` / ``policy_step`` must not touch
controller state: they see only the micro-batch they are given and the models built by
``configure_model`` on their own rank.

Shapes use ``B`` prompts, ``G`` samples per prompt, ``N = B*G`` rows, ``P`` prompt length and ``T``
response length; the fields are listed in :mod:`rltrainer.data.batch`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.data.batch import RolloutBatch, routes_as_rows
from rltrainer.rollout.engine import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from rltrainer.trainer import Trainer

#: Hooks a subclass must override; ``Trainer.fit`` checks them once before it starts.
REQUIRED_HOOKS = ("configure_model", "configure_optimizers", "reward_step", "advantage_step", "policy_step")

#: The dict a thread's logs go to inside :meth:`StepMetrics.collect` (a pipeline's rollout thread).
_COLLECTING: ContextVar[dict[str, float] | None] = ContextVar("rltrainer_collecting", default=None)


class StepMetrics:
    """Where :meth:`RLModule.log` writes: the current step's metrics (``current``), or, inside
    :meth:`collect`, the thread's own dict: a pipeline runs ``rollout_step`` in a thread of its own,
    so what it logs travels with its batch (``batch.logged``), not into the step the trainer is on
    while it generates."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def log(self, name: str, value: float) -> None:
        target = _COLLECTING.get()
        (self.current if target is None else target)[name] = float(value)

    def add(self, metrics: dict[str, float]) -> None:
        """Add ``metrics`` to the current step's."""
        self.current.update(metrics)

    @contextmanager
    def collect(self) -> Iterator[dict[str, float]]:
        """The dict this thread's logs go to until the block ends."""
        logged: dict[str, float] = {}
        token = _COLLECTING.set(logged)
        try:
            yield logged
        finally:
            _COLLECTING.reset(token)


@dataclass
class Attachment:
    """What a Trainer hands its module at setup (:meth:`RLModule.attach`); the hooks read these and
    never the Trainer, so a step runs with fakes and no Trainer at all."""

    off_policy: bool = False  # rows may come from other weights or log-probs than the trainer's
    vocab_size: int | None = None  # the policy's (prompt ids are checked against it)
    record_generations: Callable[[RolloutBatch, str], None] | None = None  # the LogGenerations callback's
    metrics: StepMetrics = field(default_factory=StepMetrics)  # where log() writes
    trainer: Any = None  # for the read-only RLModule.trainer only


class RLModule(torch.nn.Module):
    """Base class for RL algorithms. Subclass it and override the hooks.

    Attributes a subclass sets (in ``__init__``), read by the Trainer's loop:

    - ``tokenizer``: a transformers tokenizer (picklable).
    - ``sampling``: :class:`SamplingParams` for training rollouts (``n`` is the group size ``G``).
    - ``update_epochs`` (default 1) and ``mini_batch_size`` (rows per optimizer step; default: the
      whole batch, one optimizer step per training step).

    Models built in :meth:`configure_model` by convention: ``self.policy`` (required; its weights are
    what the rollout engine receives), ``self.ref_policy`` (optional, frozen), ``self.critic``
    (optional, PPO).
    """

    update_epochs: int = 1
    mini_batch_size: int | None = None
    #: set by ``Trainer.fit`` before setup, so ``configure_optimizers`` can size an LR schedule on every
    #: rank: the run's optimizer steps (training steps x ``update_epochs`` x mini-batches per batch),
    #: ``None`` when the run's length is unknown (:func:`rltrainer.schedulers.estimate_optimizer_steps`).
    estimated_optimizer_steps: int | None = None
    #: the ``Trainer(pipeline=...)`` modes the module can run under (``None``: all); ``fit`` refuses
    #: the others before setup, with ``pipeline_reason`` in the message.
    supported_pipelines: tuple[str, ...] | None = None
    pipeline_reason: str = ""
    #: multi-turn episodes (:class:`rltrainer.envs.MultiTurn`) that the default ``rollout_step`` and
    #: ``validation_step`` run instead of single-turn sampling; ``None``: single turn.
    environment: Any = None
    #: the score of a full-credit answer, read by the default ``validation_step`` (``val/full_credit``);
    #: GRPO derives it from its reward functions (their ``max_score``, default 1.0, times their weights).
    max_score: float = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.sampling = SamplingParams()
        self.tokenizer: Any = None
        self._attached = Attachment()  # what the Trainer hands over at setup (none outside a Trainer)
        self._prompt_source: Any = None  # during fit: the pipeline's run, which draw_prompts asks

    # -- where the module lives -----------------------------------------------------------------
    def attach(self, attachment: Attachment) -> None:
        """Take what the run lends (the Trainer calls it at setup; a test may, with fakes): whether
        rows are off-policy, the vocabulary size, the generations recorder and the metrics sink."""
        self._attached = attachment

    @property
    def attached(self) -> Attachment:
        """What the run lent at setup (:class:`Attachment`; defaults outside a Trainer)."""
        return self._attached

    @property
    def trainer(self) -> Trainer:
        """The Trainer fitting this module (read-only; the hooks need none of it)."""
        if self._attached.trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer (call trainer.fit(module, ...)).")
        return self._attached.trainer

    @property
    def logged_metrics(self) -> dict[str, float]:
        """What :meth:`log` recorded for the current step (outside a Trainer: since the module was built)."""
        return self._attached.metrics.current

    def log(self, name: str, value: float) -> None:
        """Record a scalar for the current step (controller hooks only), in the metrics the run lent
        (:class:`StepMetrics`); outside a Trainer, :attr:`logged_metrics` keeps it."""
        self._attached.metrics.log(name, value)

    def draw_prompts(self) -> RolloutBatch | None:
        """During ``fit``, for a ``rollout_step`` that needs more prompts than its batch (dynamic
        sampling): the next loader batch as prompt rows with ``prompt_position [B, 3]``, or ``None``
        when the data ran out. It counts as consumed (the epoch and resume position move past it).
        Only ``pipeline="sync"`` offers it; a module that uses it sets ``supported_pipelines``."""
        source = getattr(self, "_prompt_source", None)
        if source is None:
            raise RuntimeError(f"{type(self).__name__}.draw_prompts() is only available inside fit(), "
                               "from rollout_step")
        return source.draw_prompts()

    def record_generations(self, batch: RolloutBatch, split: str) -> None:
        """Keep sample rows of a scored batch for the loggers (:class:`~rltrainer.LogGenerations`):
        ``split="train"`` on the steps that log them, ``"val"`` until its ``rows`` are kept. The loop
        and the default :meth:`validation_step` call it; a custom ``validation_step`` may too. Outside
        a Trainer, or with no ``LogGenerations`` callback, it does nothing."""
        if self._attached.record_generations is not None:
            self._attached.record_generations(batch, split)

    def prompt_vocab_size(self) -> int | None:
        """The policy's vocabulary size (its config's ``vocab_size``, handed over at setup), or
        ``len(tokenizer)`` outside a Trainer; prompt token ids must be below it."""
        size = self._attached.vocab_size
        if size is None and self.tokenizer is not None and hasattr(self.tokenizer, "__len__"):
            size = len(self.tokenizer)
        return size

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_attached"] = Attachment()  # what the controller lent never travels to workers
        state["_prompt_source"] = None
        return state

    # -- models ---------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the models on this training rank. Required.

        Runs on every training rank, once, before anything else; the Strategy then places (and
        shards) them. Set ``self.policy`` to a transformers causal LM (``PreTrainedModel``); set
        ``self.ref_policy`` for a frozen reference, ``self.critic`` for a value model.

        Example::

            def configure_model(self):
                self.policy = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")
        """
        raise NotImplementedError

    def configure_optimizers(self) -> Any:
        """Return the optimizer for the trainable models. Required.

        Runs on every training rank after the Strategy has placed the models. Return an optimizer,
        or a dict ``{"optimizer": opt, "lr_scheduler": sched}`` (the scheduler steps once per
        optimizer step).

        Example::

            def configure_optimizers(self):
                return torch.optim.AdamW(self.policy.parameters(), lr=1e-6)
        """
        raise NotImplementedError

    def trainable_models(self) -> dict[str, torch.nn.Module]:
        """Models trained by ``policy_step`` (default: ``policy``, plus ``critic`` if set)."""
        models = {"policy": self.policy}
        if getattr(self, "critic", None) is not None:
            models["critic"] = self.critic
        return models

    # -- control flow (controller) --------------------------------------------------------------
    def rollout_step(self, batch: RolloutBatch, engine: RolloutEngine) -> RolloutBatch:
        """Generate ``G`` responses per prompt. Runs on the controller, every step.

        Receives ``B`` rows with the non-tensor field ``prompt_ids`` (and every dataset column).
        Returns ``N = B*G`` rows (each prompt row repeated ``G`` times, samples adjacent) with the
        tensors ``prompts [N, P]``, ``responses [N, T]``, ``response_mask [N, T]``,
        ``input_ids / attention_mask / position_ids [N, P+T]``, ``rollout_log_probs [N, T]``,
        ``policy_version [N]`` (the version of the weights that generated each row; if missing,
        the pipeline sets the engine's version when the call started) and the non-tensors ``uid``
        and ``response_text``. It may run in a controller thread while the policy trains
        (``pipeline="one_step_off"`` / ``"async"``); ``engine`` then stands for one replica.

        The prompt rows carry ``prompt_position [B, 3]`` (epoch, loader batch, row), which
        ``batch.repeat`` keeps. A ``rollout_step`` that needs more prompts (dynamic sampling) may
        call ``self.draw_prompts()`` for the next loader batch (``pipeline="sync"`` only);
        it then returns rows of any of the prompts it was given or drew, ``G`` per prompt, with
        their ``prompt_position`` carried over.

        The default samples with ``self.sampling``, or, with ``self.environment`` set, runs ``G``
        multi-turn episodes per prompt (:class:`rltrainer.envs.MultiTurn`; its ``env/*`` metrics are
        logged); override it for other rollouts.
        """
        return self.sample(batch, engine, self.sampling, log_metrics=True)

    def sample(self, batch: RolloutBatch, engine: RolloutEngine, sampling: SamplingParams,
               log_metrics: bool = False) -> RolloutBatch:
        """Rows for ``batch`` under ``sampling``: single-turn, or ``self.environment``'s episodes."""
        if self.environment is None:
            return generate_rollouts(batch, engine, sampling, self.tokenizer.pad_token_id, self.prompt_vocab_size())
        out = self.environment.rollout(batch, engine, sampling, self.tokenizer)
        metrics, out.env_metrics = out.env_metrics, {}
        for name, value in metrics.items():
            if log_metrics:
                self.log(name, value)
        return out

    def reward_step(self, batch: RolloutBatch) -> RolloutBatch:
        """Score the responses. Required. Runs on the controller, every step.

        Receives the ``N`` rows from :meth:`rollout_step`; returns them with ``scores [N]`` (float).
        Log extra metrics with ``self.log(name, value)``.
        """
        raise NotImplementedError

    def advantage_step(self, batch: RolloutBatch) -> RolloutBatch:
        """Compute advantages. Required. Runs on the controller, every step, after
        :meth:`compute_step`, with the whole batch (so groups are complete).

        Returns the batch with ``advantages [N, T]`` (0 on padding), and ``returns [N, T]`` if a
        critic is trained.
        """
        raise NotImplementedError

    # -- compute flow (every training rank) -----------------------------------------------------
    def compute_stages(self) -> list[str]:
        """Names of the forward passes to run before the update, in order (controller).

        Each stage is one call of :meth:`compute_step` over the whole batch, timed as
        ``timing_s/<stage>``. Default: ``["old_log_prob"]``, plus ``"ref"`` if the module sets
        ``use_reference = True`` (and builds ``self.ref_policy`` in :meth:`configure_model`).
        """
        stages = ["old_log_prob"]
        if getattr(self, "use_reference", False):
            stages.append("ref")
        return stages

    def compute_step(self, micro_batch: RolloutBatch, stage: str) -> dict[str, torch.Tensor]:
        """Forward passes needed before the update. Runs on every training rank, per micro-batch,
        under ``torch.no_grad()``, once per stage of :meth:`compute_stages`, after
        :meth:`reward_step` and before :meth:`advantage_step`.

        Returns tensors with the micro-batch's rows as first dimension; the Strategy gathers them
        into the batch. The default handles ``"old_log_prob"`` (``old_log_probs [n, T]`` from
        ``self.policy``) and ``"ref"`` (``ref_log_probs [n, T]`` from ``self.ref_policy``).
        """
        from rltrainer.models import response_log_probs

        temperature = micro_batch.temperature or 1.0
        routes = self.route_kwargs(micro_batch)  # a MoE policy's replayed routes (R3)
        if stage == "old_log_prob":
            return {"old_log_probs": response_log_probs(self.policy, micro_batch, temperature, **routes)[0]}
        if stage == "ref":
            return {"ref_log_probs": response_log_probs(self.ref_policy, micro_batch, temperature, **routes)[0]}
        raise ValueError(f"{type(self).__name__}.compute_step has no stage {stage!r}; override it to add one")

    def records_routes(self) -> bool:
        """Whether the rollout engine records the experts each token went to, for a
        mixture-of-experts policy (:attr:`~rltrainer.rollout.engine.RolloutEngine.return_routed_experts`;
        the rows then carry ``routed_experts [N, P+T, L, K]``). Asked by the Trainer at setup.
        Default: no; :class:`~rltrainer.modules.PolicyGradient` asks its routing part."""
        return False

    def route_kwargs(self, micro_batch: RolloutBatch) -> dict[str, Any]:
        """The :func:`~rltrainer.models.response_log_probs` arguments for ``micro_batch``'s routes:
        ``{"routed_experts": ..., "replay_routes": True}`` to replay them (routing replay, R3), or
        nothing. Default: replay the rows' routes when they carry any."""
        if "routed_experts" not in micro_batch:
            return {}
        return {"routed_experts": micro_batch["routed_experts"], "replay_routes": True}

    def policy_step(self, micro_batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss. Required. Runs on every training rank, per micro-batch, with gradients.

        Returns ``(loss, metrics)``. Normalise by the counts of the whole mini-batch, given as
        ``micro_batch.global_tokens`` (response tokens) and ``micro_batch.global_rows``, not by the
        micro-batch's own: the Strategy sums the gradients of all micro-batches on all ranks, so the
        result does not depend on micro-batching or the number of ranks. For the same reason each
        metric must be a contribution that sums to the mini-batch value (e.g. ``clipped.sum() /
        global_tokens``).

        Multi-rank strategies give every rank the same number of micro-batches, so a rank short of
        rows also runs this hook on a padding micro-batch (``micro_batch.padding`` is True, its
        ``response_mask`` and ``advantages`` all zero): the strategy multiplies that loss by 0 and
        drops its metrics, so even a loss that ignores the mask adds nothing from it. The loss must be
        finite on an all-masked row (``0 * nan`` is ``nan``): divide by the global counts, not by
        the micro-batch's own mask sum.

        Example (REINFORCE)::

            def policy_step(self, mb):
                logp, _ = response_log_probs(self.policy, mb)
                loss = -(mb["advantages"] * logp * mb["response_mask"]).sum() / mb.global_tokens
                return loss, {"actor/pg_loss": loss.item()}
        """
        raise NotImplementedError

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Called on every training rank, every strategy, once per optimizer the rank steps, after
        the backward passes of all its micro-batches (the gradients reduced across ranks) and before
        clipping (:meth:`gradient_clip_norm`) and ``optimizer.step()``: Lightning's hook of this name.
        ``optimizer`` is what the rank steps: on ``single`` and ``fsdp2`` the torch optimizer
        ``configure_optimizers`` returned, on ``megatron`` a
        :class:`~rltrainer.strategies.megatron.optimizer.MegatronOptimizer`, whose ``param_groups``
        are megatron-core's, one per param group of yours in order. A hyperparameter set on
        ``optimizer.param_groups`` here is the one this step uses, on every strategy. It runs even
        when the step is then skipped for a non-finite gradient norm. Default: nothing.

        Example (a learning rate chosen per step, from a value the step's micro-batches carry)::

            def policy_step(self, mb):
                self._lr = mb.meta["lr"]
                ...

            def on_before_optimizer_step(self, optimizer):
                for group in optimizer.param_groups:
                    group["lr"] = self._lr
        """

    def gradient_clip_norm(self, gradient_clip_val: float | None) -> float | None:
        """The global gradient norm this optimizer step clips to (``None``: no clipping). Called on
        every training rank, every strategy, once per step, after :meth:`on_before_optimizer_step`
        and before the strategy clips and steps (megatron clips with its own norm, at whatever
        value this returns). The ranks must agree (a rank's value reaches only its own clipping).
        ``gradient_clip_val``: the strategy's setting, the default answer. Unlike Lightning's
        ``configure_gradient_clipping`` it does not clip itself: it returns the norm, and the
        strategy clips (sharded and pipelined gradients included).

        Example (a norm chosen per step, from a value the step's micro-batches carry)::

            def policy_step(self, mb):
                self._max_norm = mb.meta.get("max_norm")
                ...

            def gradient_clip_norm(self, gradient_clip_val):
                return self._max_norm or gradient_clip_val
        """
        return gradient_clip_val

    # -- validation ------------------------------------------------------------------------------
    def validation_step(self, batch: RolloutBatch, engine: RolloutEngine) -> dict[str, float]:
        """Evaluate one validation batch. Runs on the controller.

        The default samples one greedy response per prompt, scores it with :meth:`reward_step` and
        returns, weighted by rows (the Trainer averages over batches weighted by ``"val/rows"``):

        - ``val/score``: the mean score;
        - ``val/full_credit``: the share of rows whose score reaches :attr:`max_score` (full credit,
          for a partial-credit reward; for a 0/1 reward, the share right);
        - ``val/accuracy``: the share of right answers: the rows :meth:`correct_rows` marks where the
          task knows correctness (the ``gsm8k`` and ``math`` rewards, whatever a format bonus adds),
          else ``val/full_credit``.
        """
        sampling = SamplingParams(n=1, max_new_tokens=self.sampling.max_new_tokens, temperature=0.0,
                                  stop_token_ids=self.sampling.stop_token_ids)
        rollouts = self.reward_step(self.sample(batch, engine, sampling))
        self.record_generations(rollouts, "val")
        return validation_metrics(rollouts["scores"], self.max_score, self.correct_rows(rollouts))

    def correct_rows(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``[N]`` bool: the rows whose answer is right, for ``val/accuracy``; ``None`` (the default)
        when the task has no notion of right beyond full credit. Runs on the controller after
        :meth:`reward_step`. GRPO answers from its rewards that declare ``correctness``."""
        return None

    # -- lifecycle (controller) ------------------------------------------------------------------
    def on_fit_start(self) -> None:
        """Called once on the controller after setup, before the first step."""

    def on_fit_end(self) -> None:
        """Called once on the controller after the last step."""

    def teardown(self) -> None:
        """Called on the controller at the end of every ``fit`` (after success or an error) and by
        :meth:`Trainer.teardown`: release what the module started itself (:class:`~rltrainer.GRPO`
        stops its reward worker processes). It may run more than once; a later call of a hook may
        start them again."""

    def on_step_start(self, batch: RolloutBatch) -> None:
        """Called on the controller at the start of each training step (after the previous step's
        ``on_step_end``, before its ``reward_step``), in every pipeline, with the step's prompt batch:
        the ``B`` prompt rows whose rows it trains on (``prompt_ids``, the dataset columns,
        ``prompt_position [B, 3]``). With ``pipeline="sync"`` this is the batch given to
        ``rollout_step``, before it runs (prompts it draws itself are not in it); ``one_step_off`` and
        ``async`` generate ahead, so their ``rollout_step`` ran during earlier steps."""

    def on_step_end(self, metrics: dict[str, float]) -> None:
        """Called on the controller after the weight sync with this step's metrics."""

    def on_validation_start(self) -> None:
        """Called on the controller before the first validation batch."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        """Called on the controller with the aggregated validation metrics."""


def generate_rollouts(batch: RolloutBatch, engine: RolloutEngine, sampling: SamplingParams,
                      pad_token_id: int, vocab_size: int | None = None) -> RolloutBatch:
    """Sample ``sampling.n`` responses per prompt row and lay them out as the batch fields; with
    ``vocab_size``, first check every prompt token id is in ``[0, vocab_size)``."""
    if "prompt_ids" not in batch:
        raise KeyError(f"The prompt batch needs a 'prompt_ids' field (token ids per row); it has {batch.keys()}")
    if vocab_size is not None:
        check_prompt_ids(batch, vocab_size)
    gen = engine.generate(list(batch["prompt_ids"]), sampling)
    n = sampling.n
    uids = [uuid.uuid4().hex for _ in range(len(batch))]
    out = batch.repeat(n, interleave=True)
    out["uid"] = [u for u in uids for _ in range(n)]
    prompt_lists = list(out["prompt_ids"])
    P = max(len(p) for p in prompt_lists)
    prompts = torch.full((len(out), P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(out), P), dtype=torch.long)
    for i, ids in enumerate(prompt_lists):  # left padding
        prompts[i, P - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
        prompt_mask[i, P - len(ids):] = 1
    response_mask = gen.response_mask.long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    out["prompts"] = prompts  # [N, P]
    out["responses"] = gen.response_ids.long()  # [N, T]
    out["response_mask"] = response_mask  # [N, T]
    out["input_ids"] = torch.cat([prompts, gen.response_ids.long()], dim=1)  # [N, P+T]
    out["attention_mask"] = attention_mask  # [N, P+T]
    out["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P+T]
    out["rollout_log_probs"] = gen.log_probs.float() * response_mask  # [N, T]
    if gen.routed_experts is None and getattr(engine, "return_routed_experts", False):
        raise RuntimeError(f"{type(engine).__name__} was asked to record the routed experts (return_routed_experts, "
                           "for routing replay of a MoE policy) but returned none: its generate() must fill "
                           "Generation.routed_experts. Use routing_replay='off' with this engine.")
    if gen.routed_experts is not None:  # a MoE policy's routes, laid out like input_ids
        out["routed_experts"] = routes_as_rows(gen.routed_experts, [len(p) for p in prompt_lists], P,
                                               response_mask.shape[1])  # [N, P+T, L, K]
    if gen.row_weight_versions is not None:  # its replicas held different versions
        out["policy_version"] = gen.row_weight_versions.long()  # [N]
    else:
        version = gen.weight_version if gen.weight_version is not None else engine.weight_version
        out["policy_version"] = torch.full((len(out),), version, dtype=torch.long)  # [N]
    out["response_text"] = gen.text
    out["finish_reason"] = gen.finish_reason
    out.temperature = sampling.temperature
    out.rollout_metrics = {f"rollout/{k}": v for k, v in gen.metrics.items()}
    return out


def validation_metrics(scores: torch.Tensor, max_score: float, correct: torch.Tensor | None) -> dict[str, float]:
    """``val/score`` (mean), ``val/full_credit`` (share with ``score >= max_score``, up to 1e-6),
    ``val/accuracy`` (share of ``correct [N]``, or the full-credit share without it) and ``val/rows``."""
    scores = scores.float()  # [N]
    full = (scores >= max_score - 1e-6).float().mean().item()
    accuracy = correct.float().mean().item() if correct is not None else full
    return {"val/score": scores.mean().item(), "val/full_credit": full, "val/accuracy": accuracy,
            "val/rows": float(len(scores))}


def check_prompt_ids(batch: RolloutBatch, vocab_size: int) -> None:
    """Raise before generation if a prompt token id is outside ``[0, vocab_size)`` (the embedding
    would fail with ``IndexError: index out of range in self``), naming the row and the id."""
    for row, ids in enumerate(batch["prompt_ids"]):
        bad = [i for i in ids if not 0 <= int(i) < vocab_size]
        if bad:
            position = batch["prompt_position"][row].tolist() if "prompt_position" in batch else None
            where = f" (epoch, loader batch, row: {position})" if position is not None else ""
            raise ValueError(
                f"Prompt row {row}{where} has token id {bad[0]}"
                f"{f' (and {len(bad) - 1} more out of range)' if len(bad) > 1 else ''}, outside the model's "
                f"vocabulary of {vocab_size} ids [0, {vocab_size - 1}]. Tokenize the prompts with the model's own "
                f"tokenizer, or build the model with a vocab_size of at least {max(bad) + 1}.")


def check_hooks(module: RLModule) -> None:
    """Raise if ``module`` is not an RLModule or leaves a required hook unimplemented."""
    if not isinstance(module, RLModule):
        raise TypeError(f"fit() needs an rltrainer.RLModule, got {type(module).__name__}")
    missing = [h for h in REQUIRED_HOOKS if getattr(type(module), h) is getattr(RLModule, h)]
    if missing:
        raise NotImplementedError(
            f"{type(module).__name__} must override these RLModule hooks: {', '.join(missing)}. "
            "See the RLModule docstrings for what each receives and returns."
        )
