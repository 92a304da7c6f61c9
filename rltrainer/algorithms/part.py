"""What a part of a policy-gradient algorithm is: a small object that declares the forward passes
it needs and the batch fields it reads and adds, and takes part in the hooks it has a say in.

:class:`~rltrainer.modules.PolicyGradient` holds its parts in order and asks each in turn; a part
that has nothing to do at a hook inherits the base class's no-op. The hooks, in the loop's order:

- ``stages(off_policy)``, asked by ``compute_stages`` (controller): the forward passes it needs;
- ``build_models(base)``, by ``configure_model`` (every rank): its models, set on the module;
- ``optimizers(models, weight_decay)``, by ``configure_optimizers``: those of the models it trains;
- ``compute(models, micro_batch, stage)``, by ``compute_step`` (ranks): its stage, else ``None``;
- ``rollout(prompts, sampler, step)``, by ``rollout_step`` (controller): the rollout's rows, or
  ``None`` to leave it to the next part (DAPO's group filter draws and filters here);
- ``score(batch, step)``, by ``score`` after the rule rewards (controller): shape ``scores``
  (DAPO's overlong penalty);
- ``before_advantages``, ``adjust_advantages``, ``after_advantages``, by ``advantage_step``
  (controller): scores and mask before the estimator (the advantage part's ``estimate``), the
  advantages after it (distillation), then what the update needs (a loss's token selection);
- ``update(u)``, by ``policy_step`` (ranks): its term of the loss;
- ``check(setup)``, at construction: refuse what cannot work with the other parts.

What parts read and add is one graph, checked at construction (:func:`check_reads`): each field a
part :meth:`~Part.fields_read` must come from the module's own hooks (:data:`HOOK_FIELDS`, from the
hook contracts), a forward pass some part asks for (:data:`STAGE_FIELDS`) or another part's
:attr:`~Part.adds`;
otherwise the module is refused, naming the part, the field and who could provide it.

Settings are the part's dataclass fields: typed, documented and defaulted there, once (read them
on the part: ``module.parts["loss"].clip_ratio_high``). A module routes each of its flat keyword
settings to the part that declares it (:func:`rltrainer.modules.settings.route_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import torch

from rltrainer.contracts import CONTRACTS
from rltrainer.contracts import STAGE_FIELDS as CONTRACT_STAGES  # what each stage adds, by contract
from rltrainer.data.batch import RolloutBatch

#: The forward passes before ``advantage_step``, in the order they run, and the field each adds.
STAGE_FIELDS: dict[str, str] = {stage: CONTRACT_STAGES[stage].name
                                for stage in ("old_log_prob", "ref", "teacher", "reward_model", "values")}

#: The fields the module's hooks add, by hook: every field of the hook contracts
#: (:data:`rltrainer.contracts.CONTRACTS`, the compute stages' apart: a part asks for those), and
#: those PolicyGradient's own hooks add besides (``old_log_probs``: the stage, or the update's forward).
HOOK_FIELDS: dict[str, str] = {
    **{f.name: c.hook for c in CONTRACTS.values() if c.hook != "compute_step" for f in c.adds},
    "prompt_ids": "the loader", "finish_reason": "rollout_step", "returns": "advantage_step",
    "reward_baselines": "reward_step (the greedy baseline, when a part reads it)",
    "old_log_probs": "stage 'old_log_prob' (or the update's own forward)"}
#: Fields a part uses when the batch has them, and who may add them (not required by the check).
OPTIONAL_FIELDS: dict[str, str] = {"routed_experts": "an engine that records MoE routes",
                                   "rollout_is_weights": "a rollout correction with weights"}
#: Who can add the fields of the optional parts, for the check's message.
PROVIDERS: dict[str, str] = {
    "values": "a Critic part (stage 'values'; rltrainer.PPO has one)",
    "ref_log_probs": "a part asking for stage 'ref' (kl_coef > 0, or a KL in the reward)",
    "teacher_log_probs": "a Teacher (teacher=Teacher(...))",
    "rm_scores": "a RewardModel in reward_funcs",
    "task_scores": "an OverlongPenalty part (rltrainer.DAPO has one)"}

Log = Callable[[str, float], None]


class BaseModels(NamedTuple):
    """What a part may build its models from (``configure_model``)."""

    policy: torch.nn.Module
    tokenizer: Any
    model_spec: Any  # the policy's spec (a critic defaults to it)
    model_seed: int | None


@dataclass(frozen=True)
class Step:
    """The controller's side of a step, as a part sees it: where to log, and whether rollouts can be
    off-policy (the Trainer's ``off_policy``, or a ``rollout_correction`` set)."""

    log: Log
    off_policy: bool
    max_new_tokens: int = 0  # L_max of the responses (the module's sampling)


@dataclass(frozen=True)
class Setup:
    """The rest of the module, as a part's :meth:`Part.check` sees it at construction."""

    owner: str  # the module's class name, for messages
    num_generations: int
    stages: frozenset[str]  # every forward pass some part of the module may ask for
    environment: bool  # multi-turn episodes
    rule_rewards: bool  # reward functions scored on the controller
    reward_model: bool  # a RewardModel scored on the training ranks
    tokenizer: Any
    max_new_tokens: int = 0  # L_max of the responses


class Sampler(NamedTuple):
    """What a part's :meth:`Part.rollout` may ask of the module."""

    sample: Callable[[RolloutBatch], RolloutBatch]  # prompts -> scored rows (rollout_step's default, then score)
    draw_prompts: Callable[[], RolloutBatch | None] | None  # the next loader batch (None: not inside fit)
    group_size: int  # G
    pad_token_id: int


@dataclass
class Update:
    """One micro-batch of ``policy_step``, as the parts see it; each adds to ``loss`` and ``metrics``.

    ``log_probs [n, T]`` carry the gradient; ``old_log_probs [n, T]`` are the batch's or, without
    them, this forward's (detached); ``counts`` are the whole mini-batch's (``global_tokens``,
    ``global_rows``, ``max_response_length``), so every term is exact under micro-batching."""

    micro_batch: RolloutBatch
    models: Mapping[str, torch.nn.Module]
    log_probs: torch.Tensor
    entropy: torch.Tensor
    old_log_probs: torch.Tensor
    loss_agg_mode: str
    counts: dict[str, Any]
    is_weights: torch.Tensor | None = None  # [n, T] off-policy IS weights (a rollout correction)
    routing: Any = None  # a MoE policy's rltrainer.models.moe.RoutingRecord of this forward (None: dense)
    loss: torch.Tensor | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def add(self, term: torch.Tensor) -> None:
        self.loss = term if self.loss is None else self.loss + term


class Part:
    """A part of a policy-gradient algorithm. Subclass it (as a dataclass whose fields are its
    settings) and override the hooks it has a say in; the others do nothing.

    Class attributes declare its ``kind`` (the key in the module's ``parts``: a part given in
    ``parts=[...]`` replaces the preset's of its kind), and, for the reader and the module's check
    (:func:`check_reads`), the batch fields the part reads and adds (``reads`` / ``adds``);
    :meth:`stages` the forward passes it needs; ``shorthands`` the settings that set a registry
    entry's parameter (setting -> (the entry's parameter, the setting's default))."""

    kind: ClassVar[str] = ""
    #: the batch fields the part reads (on the controller or in the update) and the ones it adds
    reads: ClassVar[tuple[str, ...]] = ()
    adds: ClassVar[tuple[str, ...]] = ()
    shorthands: ClassVar[dict[str, tuple[str, Any]]] = {}
    #: the pipelines the part can run in (None: all), and why, for the module's refusal
    supported_pipelines: ClassVar[tuple[str, ...] | None] = None
    pipeline_reason: ClassVar[str] = ""

    def pipelines(self) -> tuple[str, ...] | None:
        """The pipelines this part (as configured) can run in; ``None``: every one."""
        return self.supported_pipelines

    def fields_read(self) -> frozenset[str]:
        """The batch fields this part reads (:attr:`reads`, and any its settings add)."""
        return frozenset(self.reads)

    def stages(self, off_policy: bool) -> tuple[str, ...]:
        """The forward passes (keys of :data:`STAGE_FIELDS`) this part needs before ``advantage_step``."""
        return ()

    def build_models(self, base: BaseModels) -> dict[str, torch.nn.Module]:
        """Models to build on every training rank, by the attribute name the module gets."""
        return {}

    def optimizers(self, models: Mapping[str, torch.nn.Module], weight_decay: float) -> list[dict[str, Any]]:
        """Optimizers (``{"optimizer": ...}``) of the models this part trains."""
        return []

    def compute(self, models: Mapping[str, torch.nn.Module], micro_batch: RolloutBatch, stage: str
                ) -> dict[str, torch.Tensor] | None:
        """The tensors of ``stage`` for ``micro_batch`` if it is this part's stage, else ``None``."""
        return None

    def rollout(self, prompts: RolloutBatch, sampler: Sampler, step: Step) -> RolloutBatch | None:
        """The rollout's rows for ``prompts``, or ``None``: the module's own sampling."""
        return None

    def score(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        """After the rule rewards (``scores [N]``): shape them."""
        return batch

    def before_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        return batch

    def adjust_advantages(self, batch: RolloutBatch, advantages: torch.Tensor, step: Step) -> torch.Tensor:
        return advantages

    def after_advantages(self, batch: RolloutBatch, step: Step) -> RolloutBatch:
        return batch

    def update(self, u: Update) -> None:
        """Add this part's term to ``u.loss`` (and its metrics to ``u.metrics``)."""

    def check(self, setup: Setup) -> None:
        """Refuse, at construction, what cannot work with the rest of the module (raise)."""

    def exposed(self) -> dict[str, Any]:
        """This part's settings by their flat keywords, as the module's ``flat_settings()`` shows them
        (the loggers' hyperparameters); a ``*_kwargs`` setting shows the entry's full parameters."""
        return settings_of(self)


def settings_of(group: Any) -> dict[str, Any]:
    """A part's (or a settings group's) settings: the dataclass fields given at construction."""
    return {f.name: getattr(group, f.name) for f in fields(group) if f.init}


def check_reads(owner: str, parts: Mapping[str, Part], stages: frozenset[str]) -> None:
    """Refuse a module one of whose parts reads a field nothing provides: not the module's own hooks
    (:data:`HOOK_FIELDS`), not optional (:data:`OPTIONAL_FIELDS`), not a forward pass some part asks
    for (``stages``, :data:`STAGE_FIELDS`), and no part's ``adds``. The error names the part, the
    field and who could provide it."""
    provided = {**HOOK_FIELDS, **OPTIONAL_FIELDS, **{STAGE_FIELDS[s]: f"stage {s!r}" for s in stages}}
    for kind, part in parts.items():
        provided.update({name: f"the {kind} part" for name in part.adds})
    for kind, part in parts.items():
        for name in sorted(part.fields_read()):
            if name not in provided:
                could = PROVIDERS.get(name, "a part that declares it in its adds")
                raise ValueError(f"{owner}: the {kind} part ({type(part).__name__}) reads {name!r}, which no part or "
                                 f"hook of this module provides. It could come from {could}: add that part, or leave "
                                 f"the {kind} part out.")
