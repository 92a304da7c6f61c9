"""Single-device strategy: one process, one device (CPU or one GPU), no Ray, so breakpoints work."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.data.batch import RolloutBatch
from rltrainer.strategies.strategy import STRATEGIES, Strategy, autocast_context, param_dtype

if TYPE_CHECKING:
    from rltrainer.module import RLModule

log = logging.getLogger(__name__)


@STRATEGIES.register("single")
class SingleDeviceStrategy(Strategy):
    """Everything on one device in the controller's process.

    Args:
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        devices: must be 1 (accepted so ``Trainer(devices=1)`` resolves here).
        **kwargs: micro-batching, clipping and precision, see :class:`Strategy`.
    """

    def __init__(self, device: str | torch.device = "auto", devices: int | str = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
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

    @property
    def device(self) -> torch.device:
        return self._device

    def setup(self, module: RLModule, seed: int) -> None:
        torch.manual_seed(seed)
        module.configure_model()
        if getattr(module, "policy", None) is None:
            raise RuntimeError(f"{type(module).__name__}.configure_model() must set self.policy")
        module.to(device=self.device, dtype=param_dtype(self.precision))
        self.module = module
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())

    def _models(self) -> list[torch.nn.Module]:
        return list(self.module.trainable_models().values())

    def compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        module = self.module
        for m in self._models():
            m.eval()
        outputs: list[dict[str, torch.Tensor]] = []
        with torch.no_grad(), autocast_context(self.precision, self.device):
            for mb in self.micro_batches(batch.to(self.device)):
                outputs.append(module.compute_step(mb, stage))
        keys = outputs[0].keys() if outputs else []
        return RolloutBatch({k: torch.cat([o[k].float().cpu() for o in outputs]) for k in keys}, batch_size=len(batch))

    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        module = self.module
        models = self._models()
        for m in models:
            m.train()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor | float] = {}
        for mb in self.micro_batches(mini_batch.to(self.device)):
            with autocast_context(self.precision, self.device):
                loss, metrics = module.policy_step(mb)
            loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + (v.detach().float() if isinstance(v, torch.Tensor) else v)
        params = [p for m in models for p in m.parameters() if p.requires_grad]
        grad_norm = clip_gradients(params, self.gradient_clip_val)
        out = {k: float(v) for k, v in totals.items()}
        out["actor/grad_norm"] = grad_norm
        out["actor/lr"] = self.optimizers[0].param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            for opt in self.optimizers:
                opt.step()
            for sched in self.schedulers:
                sched.step()
        else:
            log.warning("Non-finite gradient norm (%s): optimizer step skipped", grad_norm)
        return out

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        policy = self.module.policy
        for name, tensor in policy.named_parameters():
            yield name, tensor.detach().to(dtype) if dtype else tensor.detach()

    def model_config(self) -> Any:
        return self.module.policy.config

    def state_dict(self) -> dict[str, Any]:
        return {
            "models": {name: m.state_dict() for name, m in self.module.trainable_models().items()},
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [s.state_dict() for s in self.schedulers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, m in self.module.trainable_models().items():
            m.load_state_dict(state["models"][name])
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        for sched, s in zip(self.schedulers, state["schedulers"]):
            sched.load_state_dict(s)


def normalize_optimizers(config: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Accept an optimizer, ``{"optimizer", "lr_scheduler"}``, or a list of either."""
    items = config if isinstance(config, (list, tuple)) else [config]
    optimizers, schedulers = [], []
    for item in items:
        if isinstance(item, dict):
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                schedulers.append(item["lr_scheduler"])
        elif isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        else:
            raise TypeError(
                "configure_optimizers() must return an optimizer, a dict with 'optimizer' (and "
                f"optionally 'lr_scheduler'), or a list of those; got {type(item).__name__}"
            )
    if not optimizers:
        raise ValueError("configure_optimizers() returned no optimizer")
    return optimizers, schedulers


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip to ``max_norm`` (if set) and return the total norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    return float(norm)
