"""Single-device strategy: one process, one device (CPU or one GPU), no Ray, so breakpoints work.
With ``Trainer(stage_timeout_s=...)`` its ``compute`` and ``train_step`` run under the watchdog
(stages ``single.compute``, ``single.train_step``; :meth:`~rltrainer.controller.watchdog.Watchdog.call`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.checkpoints import safe_load, save_file
from rltrainer.data.batch import RolloutBatch
from rltrainer.lora import LoraView
from rltrainer.models import state_tensors
from rltrainer.models.support import check_causal_lm, check_fast_paths
from rltrainer.strategies.strategy import (STRATEGIES, Strategy, autocast_context, form_micro_batches,
                                          load_local_training_state, local_training_state, normalize_optimizers,
                                          param_dtype, run_compute, run_train_step)
from rltrainer.weights.versions import ParamVersions

if TYPE_CHECKING:
    from rltrainer.module import RLModule

log = logging.getLogger(__name__)


@STRATEGIES.register("single")
class SingleDeviceStrategy(Strategy):
    """Everything on one device in the controller's process.

    Args:
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        devices: must be 1 (accepted so ``Trainer(devices=1)`` resolves here).
        micro_batch_size / max_tokens_per_micro_batch / gradient_clip_val / precision / padding_free:
            micro-batching, clipping and precision, see :class:`~rltrainer.strategies.strategy.Strategy`.

    The rollout engine runs in this process, on its device (:class:`~rltrainer.rollout.rollout.Rollout`).
    """

    def __init__(self, device: str | torch.device = "auto", devices: int | str = 1, micro_batch_size: int = 8,
                 max_tokens_per_micro_batch: int | None = None, gradient_clip_val: float | None = 1.0,
                 precision: str = "32-true", padding_free: bool = False) -> None:
        super().__init__(micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                         gradient_clip_val=gradient_clip_val, precision=precision, padding_free=padding_free)
        if devices not in (1, "1", "auto"):
            raise ValueError(
                f"The 'single' strategy runs on one device, got devices={devices!r}. "
                f"Use devices=1, or a distributed strategy from: {', '.join(STRATEGIES.names())}."
            )
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        self.module: RLModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self._view: Any = None  # a LoRA policy's rltrainer.lora.LoraView
        self.versions = ParamVersions()  # per parameter: what an export with only_changed still has to send

    @property
    def device(self) -> torch.device:
        """Where the models train (and where an engine connected to it runs)."""
        return self._device

    def micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """:func:`~rltrainer.strategies.strategy.form_micro_batches` with this strategy's settings."""
        return form_micro_batches(batch, self.micro_batch_size, self.max_tokens_per_micro_batch, self.padding_free)

    def setup(self, module: RLModule, seed: int) -> None:
        torch.manual_seed(seed)
        module.configure_model()
        if getattr(module, "policy", None) is None:
            raise RuntimeError(f"{type(module).__name__}.configure_model() must set self.policy")
        check_causal_lm(module.policy, "single")
        module.to(device=self.device, dtype=param_dtype(self.precision))
        check_fast_paths(module.policy, "single", self.padding_free)
        self.module = module
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())
        self.lora_config = getattr(module, "lora", None)
        self._view: Any = None

    def set_weight_view(self, mode: str | None) -> None:
        """A LoRA policy exports as ``mode`` (:class:`rltrainer.lora.LoraView`)."""
        if mode is not None and self.lora_config is None:
            raise ValueError(f"weight view {mode!r} needs a LoRA policy (the module's lora=peft.LoraConfig(...))")
        if mode is not None:
            self._view = LoraView(self.module.policy, mode)
        else:
            self._view = None
        self.weight_view = mode

    @property
    def exports_live_parameters(self) -> bool:
        """:meth:`export_weights` yields the policy's parameters themselves (not a LoRA view's
        tensors), so an engine in this process may bind to them (``InProcessTransport``)."""
        return self._view is None

    def _models(self) -> list[torch.nn.Module]:
        return list(self.module.trainable_models().values())

    def compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        if self.watchdog is not None:  # with stage_timeout_s: "single.compute" past it raises StageTimeout
            return self.watchdog.call("single.compute", self._compute, batch, stage)
        return self._compute(batch, stage)

    def _compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        micro_batches = self.micro_batches(batch.to(self.device))
        out = run_compute(self.module, micro_batches, stage, self._models(), autocast_context(self.precision, self.device))
        return RolloutBatch(out, batch_size=len(batch))

    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        if self.watchdog is not None:
            return self.watchdog.call("single.train_step", self._train_step, mini_batch)
        return self._train_step(mini_batch)

    def _train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        micro_batches = self.micro_batches(mini_batch.to(self.device))
        metrics, stepped = run_train_step(self.module, micro_batches, self._models(), self.optimizers, self.schedulers,
                                          self.gradient_clip_val,
                                          lambda: autocast_context(self.precision, self.device),
                                          grads_into_parameters=True)
        self.versions.bump(self._view.outputs_of(stepped) if self._view is not None else stepped)
        return metrics

    def export_weights(self, dtype: torch.dtype | None = None,
                       only_changed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        params = {n: t.detach() for n, t in state_tensors(self.module.policy).items()}  # persistent buffers too
        view = self._view
        names = list(view.specs) if view is not None else list(params)
        names = self.versions.changed(names) if only_changed else names
        for name in names:
            tensor = view.tensor(name, params) if view is not None else params[name]
            yield name, tensor.to(dtype) if dtype else tensor
        if only_changed:
            self.versions.mark_synced(names)

    def weight_names(self) -> list[str]:
        if self._view is not None:
            return list(self._view.specs)
        return list(state_tensors(self.module.policy))

    def model_config(self) -> Any:
        return self.module.policy.config

    def forget_synced(self, groups: list[list[str]] | None = None) -> None:
        if groups is not None:
            self.versions.set_groups(groups)
        self.versions.forget_synced()

    def state_dict(self) -> dict[str, Any]:
        return local_training_state(self.module, self.optimizers, self.schedulers)

    def load_state_dict(self, state: dict[str, Any], optimizer: bool = True) -> None:
        load_local_training_state(self.module, self.optimizers, self.schedulers, state, optimizer=optimizer)
        self.versions.forget_synced()

    def save_checkpoint(self, directory: Path, async_save: bool = False) -> dict[str, Any]:
        """:meth:`state_dict` as one file, written at once (``async_save`` changes nothing here)."""
        save_file(self.state_dict(), directory / "state.pt", "the models, optimizers and schedulers")
        return {}

    def load_checkpoint(self, directory: Path, state: dict[str, Any], *, optimizer: bool = True) -> None:
        self.load_state_dict(safe_load(directory / "state.pt", "the models, optimizers and schedulers"), optimizer)
