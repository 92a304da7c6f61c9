"""The ``Strategy`` interface: owns the training compute (model placement, micro-batching,
backward, optimizer step) and the export of weights in HF names for the rollout engine.

A Strategy never knows the algorithm: it runs the module's ``compute_step`` (no grad) and
``policy_step`` (with grad) on the micro-batches it forms, wherever its ranks are.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.registry import Registry

if TYPE_CHECKING:
    from rltrainer.module import RLModule

STRATEGIES: Registry[Strategy] = Registry("strategy")

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


class Strategy(abc.ABC):
    """Distributed (or single-device) training compute.

    Args:
        micro_batch_size: rows per forward/backward pass on each rank.
        max_tokens_per_micro_batch: if set, micro-batches are formed by a token budget instead
            (dynamic batch size): consecutive rows while ``rows x longest row`` fits.
        gradient_clip_val: clip the global gradient norm to this value (``None``: no clipping).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
    """

    def __init__(self, micro_batch_size: int = 8, max_tokens_per_micro_batch: int | None = None,
                 gradient_clip_val: float | None = 1.0, precision: str = "32-true") -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {precision!r}. Available: {', '.join(PRECISIONS)}")
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.gradient_clip_val = gradient_clip_val
        self.precision = precision

    @property
    def world_size(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @abc.abstractmethod
    def setup(self, module: RLModule, seed: int) -> None:
        """Build the module's models on every rank (``configure_model``), place them, build the
        optimizers (``configure_optimizers``)."""

    @abc.abstractmethod
    def compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        """Run ``module.compute_step(micro_batch, stage)`` over ``batch`` under no_grad; return its
        outputs as a batch of the same rows."""

    @abc.abstractmethod
    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step over ``mini_batch``: ``policy_step`` + backward per micro-batch,
        gradients summed, clipped, stepped. Returns the summed metrics plus ``actor/grad_norm``
        and ``actor/lr``."""

    @abc.abstractmethod
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for the policy, cast to ``dtype`` if given."""

    @abc.abstractmethod
    def model_config(self) -> Any:
        """The policy's transformers config (the engine builds its own model from it)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: model(s), optimizer(s), scheduler(s)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def teardown(self) -> None:
        """Release processes and memory."""

    # -- helpers shared by implementations ------------------------------------------------------
    def micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Split by ``max_tokens_per_micro_batch`` if set, else by ``micro_batch_size`` rows."""
        if self.max_tokens_per_micro_batch:
            return batch.split_by_tokens(self.max_tokens_per_micro_batch)
        return batch.split(self.micro_batch_size)


def build_strategy(strategy: str | Strategy, **kwargs: Any) -> Strategy:
    """Resolve a registered name (``"single"``, presets...) or pass an instance through."""
    if isinstance(strategy, Strategy):
        return strategy
    return STRATEGIES.build(strategy, **kwargs)


def autocast_context(precision: str, device: torch.device) -> Any:
    """``torch.autocast`` for the mixed precisions, a null context otherwise."""
    import contextlib

    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def param_dtype(precision: str) -> torch.dtype:
    return {"bf16-true": torch.bfloat16}.get(precision, torch.float32)
