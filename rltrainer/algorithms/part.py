"""What a part of a policy-gradient algorithm is: a small object that declares the forward passes
it needs and the batch fields it reads and adds, and takes part in the hooks it has a say in.

:class:`~rltrainer.modules.PolicyGradient` holds its parts in order and asks each in turn; a part
that has nothing to do at a hook inherits the base class's no-op. The hooks, in the loop's order:

- ``stages(off_policy)``, asked by ``compute_stages`` (controller): the forward passes it needs;
- ``build_models(base)``, by ``configure_model`` (every rank): its models, set on the module;
- ``optimizers(models, weight_decay)``, by ``configure_optimizers``: those of the models it trains;
- ``compute(models, micro_batch, stage)``, by ``compute_step`` (ranks): its stage, else ``None``;
- ``before_advantages``, ``adjust_advantages``, ``after_advantages``, by ``advantage_step``
  (controller): scores and mask before the estimator (the advantage part's ``estimate``), the
  advantages after it (distillation), then what the update needs (a loss's token selection);
- ``update(u)``, by ``policy_step`` (ranks): its term of the loss;
- ``check(setup)``, at construction: refuse what cannot work with the other parts.

Settings are the part's dataclass fields: typed, documented and defaulted there, once. A module
routes each of its keyword settings to the part that declares it
(:func:`rltrainer.modules.settings.route_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import torch

from rltrainer.data.batch import RolloutBatch

#: The forward passes before ``advantage_step``, in the order they run, and the field each adds.
STAGE_FIELDS: dict[str, str] = {"old_log_prob": "old_log_probs", "ref": "ref_log_probs",
                                "teacher": "teacher_log_probs", "reward_model": "rm_scores", "values": "values"}

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

    Class attributes declare, for the reader and the module's checks, the batch fields the part
    reads and adds (``reads`` / ``adds``); :meth:`stages` the forward passes it needs."""

    #: the batch fields the part reads (on the controller or in the update) and the ones it adds
    reads: ClassVar[tuple[str, ...]] = ()
    adds: ClassVar[tuple[str, ...]] = ()

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
        """The module attributes that show this part's settings (read them; a change goes through a new part)."""
        return settings_of(self)


def settings_of(part: Any) -> dict[str, Any]:
    """A part's settings: the dataclass fields given at construction."""
    return {f.name: getattr(part, f.name) for f in fields(part) if f.init}
