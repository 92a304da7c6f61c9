"""The ``Strategy`` interface: owns the training compute (model placement, micro-batching,
backward, optimizer step) and the export of weights in HF names for the rollout engine.

A Strategy never knows the algorithm: it runs the module's ``compute_step`` (no grad) and
``policy_step`` (with grad) on the micro-batches it forms, wherever its ranks are.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.allocator import release_free_heap
from rltrainer.checkpoints import CheckpointError, check_files, check_state_matches, shapes
from rltrainer.contracts import check_hook_result
from rltrainer.data.batch import RolloutBatch
from rltrainer.lm_head import gradients_into_parameters
from rltrainer.registry import Registry
from rltrainer.weights.versions import stepped_parameter_names
from rltrainer.values import check_float, check_int

if TYPE_CHECKING:
    from rltrainer.controller.watchdog import Watchdog
    from rltrainer.module import RLModule

log = logging.getLogger(__name__)

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
        padding_free: run each micro-batch's rows packed into one sequence without their padding
            (:mod:`rltrainer.packing`; TRL's ``padding_free``, verl's ``use_remove_padding``), in
            the compute stages and the update; ``max_tokens_per_micro_batch`` then counts real
            tokens. The strategy sets each micro-batch's typed field
            :attr:`~rltrainer.data.batch.RolloutBatch.padding_free` and
            :func:`~rltrainer.models.response_log_probs` reads it.
    """

    def __init__(self, micro_batch_size: int = 8, max_tokens_per_micro_batch: int | None = None,
                 gradient_clip_val: float | None = 1.0, precision: str = "32-true", padding_free: bool = False) -> None:
        micro_batch_size = check_int("micro_batch_size", micro_batch_size, at_least=1,
                                     meaning="rows per forward/backward")
        max_tokens_per_micro_batch = check_int("max_tokens_per_micro_batch", max_tokens_per_micro_batch, at_least=1,
                                               none="micro_batch_size rows", meaning="tokens per forward/backward")
        gradient_clip_val = check_float("gradient_clip_val", gradient_clip_val, above=0, none="no clipping",
                                        meaning="the max global gradient norm")
        if precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {precision!r}. Available: {', '.join(PRECISIONS)}")
        if not isinstance(padding_free, bool):
            raise ValueError(f"padding_free must be True (pack each micro-batch's rows without padding) or False "
                             f"(padded rows), got {padding_free!r}")
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.gradient_clip_val = gradient_clip_val
        self.precision = precision
        self.padding_free = padding_free
        #: the controller's :class:`~rltrainer.controller.watchdog.Watchdog` over the waits on worker
        #: processes and, with ``stage_timeout_s``, on in-process stages (``single.train_step``); the
        #: Trainer sets it from ``stage_timeout_s``; ``None``: waits have no limit.
        self.watchdog: Watchdog | None = None
        self.lora_config: Any = None  # the module's peft.LoraConfig, if its policy is a LoRA one (set up)
        self.weight_view: str | None = None  # a LoRA policy's export names (rltrainer.lora.LORA_VIEWS)

    @property
    def world_size(self) -> int:
        return 1

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
        gradients summed, clipped, stepped. Returns the metrics combined over micro-batches and
        ranks (:func:`combine_metrics`) plus ``actor/grad_norm`` and ``actor/lr``."""

    @abc.abstractmethod
    def export_weights(self, dtype: torch.dtype | None = None,
                       only_changed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for the policy, cast to ``dtype`` if given; with
        ``only_changed``, only the parameters whose version moved since the last sync, and once the
        iterator is exhausted they count as synced."""

    @abc.abstractmethod
    def weight_names(self) -> list[str]:
        """The policy's parameter names, as :meth:`export_weights` yields them."""

    def set_weight_view(self, mode: str | None) -> None:
        """Export a LoRA policy as ``mode`` (:data:`rltrainer.lora.LORA_VIEWS`: ``"merged"``,
        ``"adapter"``, ``"adapter_only"``; ``None`` without LoRA); the engine's
        :class:`~rltrainer.weights.sync.WeightSync` holds the view it loads. A strategy that trains
        LoRA overrides it; this one refuses a view it cannot give."""
        if mode is not None:
            raise NotImplementedError(f"{type(self).__name__} does not train LoRA policies")
        self.weight_view = mode

    @abc.abstractmethod
    def forget_synced(self, groups: list[list[str]] | None = None) -> None:
        """The engine lost its weights, or is new: the next export with ``only_changed`` sends every
        weight. ``groups``: a new engine's names that travel together
        (``RolloutEngine.weight_groups``): when one changed, every name of its group is sent."""

    @abc.abstractmethod
    def model_config(self) -> Any:
        """The policy's transformers config (the engine builds its own model from it)."""

    @abc.abstractmethod
    def save_checkpoint(self, directory: Path, async_save: bool = False) -> dict[str, Any]:
        """Write models, optimizers and schedulers into ``directory`` (new and empty; part of a
        checkpoint still under its temporary name, see :mod:`rltrainer.checkpoints`). Returns the
        small state the controller keeps in ``trainer.pt``. With ``async_save`` a strategy may
        return before the files are written (:meth:`wait_checkpoint` waits)."""

    def wait_checkpoint(self) -> None:
        """Wait until the files of the last :meth:`save_checkpoint` are written."""

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        """After :meth:`wait_checkpoint`: the sha256 of the files the ranks wrote into ``directory``
        (by name relative to it), each hashed by the rank that wrote it. Here none: the controller
        wrote them and hashes them (:func:`~rltrainer.checkpoints.write_manifest`)."""
        return {}

    def verify_checkpoint(self, directory: Path, expected: dict[str, str]) -> list[str]:
        """Before :meth:`load_checkpoint`: what is wrong with the files in ``directory`` against their
        recorded sha256 ``expected`` (one line each, :func:`~rltrainer.checkpoints.check_files`). Here:
        checked in this process."""
        return check_files(directory, expected)

    @abc.abstractmethod
    def load_checkpoint(self, directory: Path, state: dict[str, Any], *, optimizer: bool = True) -> None:
        """The inverse of :meth:`save_checkpoint` (``state``: what it returned); raises
        :class:`~rltrainer.checkpoints.CheckpointError` for a part missing, unreadable or of another model.
        With ``optimizer=False`` the models and LR schedulers load and every optimizer the ranks
        step starts afresh: no state (no moments, step count 0), its param groups' hyperparameters
        as they are (Tinker's ``load_state``: weights only)."""

    def teardown(self) -> None:
        """Release processes and memory."""


def form_micro_batches(batch: RolloutBatch, micro_batch_size: int, max_tokens: int | None,
                       padding_free: bool = False) -> list[RolloutBatch]:
    """Split by the token budget ``max_tokens`` if set (real tokens with ``padding_free``, else
    rows x longest row), else by ``micro_batch_size`` rows. Each part's
    :attr:`~rltrainer.data.batch.RolloutBatch.padding_free` is set here, the one place it is set
    (``True``: its forward passes run packed)."""
    if max_tokens:
        parts = batch.split_by_tokens(max_tokens, packed=padding_free)
    else:
        parts = batch.split(micro_batch_size)
    for part in parts:
        part.padding_free = padding_free
    return parts


def run_micro_batches(hook: Callable[[RolloutBatch], Any], micro_batches: list[RolloutBatch],
                      backward: bool) -> list[Any]:
    """Call ``hook`` on each micro-batch in turn (and, with ``backward``, back-propagate the loss it
    returns first). Returns the hook's outputs. A strategy with a schedule of its own (megatron's
    pipeline) replaces this; it may return no outputs on ranks that do not hold them."""
    outputs = []
    for mb in micro_batches:
        out = hook(mb)
        if backward:
            out[0].backward()
        outputs.append(out)
    return outputs


def run_compute(module: RLModule, micro_batches: list[RolloutBatch], stage: str, models: list[torch.nn.Module],
                autocast: Any, runner: Callable[..., list[Any]] = run_micro_batches) -> dict[str, torch.Tensor]:
    """Rank-side: ``compute_step`` over ``micro_batches`` under no_grad; outputs concatenated on CPU
    (empty on a rank that holds none, e.g. a pipeline stage before the last)."""
    for m in models:
        m.eval()

    def step(mb: RolloutBatch) -> dict[str, torch.Tensor]:
        release_free_heap()  # what the previous micro-batch freed (rltrainer.allocator)
        return check_hook_result(module, "compute_step", module.compute_step(mb, stage), received=mb, stage=stage)

    with torch.no_grad(), autocast:
        outputs = runner(step, micro_batches, False)
    keys = outputs[0].keys() if outputs else []
    out = {k: torch.cat([o[k].float().cpu() for o in outputs]) for k in keys}
    release_free_heap()
    return out


def run_train_step(module: RLModule, micro_batches: list[RolloutBatch], models: list[torch.nn.Module],
                   optimizers: list[torch.optim.Optimizer], schedulers: list[Any], clip: float | None,
                   autocast_factory: Any, clip_fn: Any = None,
                   runner: Callable[..., list[Any]] = run_micro_batches,
                   grads_into_parameters: bool = False) -> tuple[dict[str, float], list[str]]:
    """Rank-side: ``policy_step`` + backward per micro-batch, then the module's
    ``on_before_optimizer_step(optimizer)`` for each optimizer, clip to the norm the module's
    ``gradient_clip_norm(clip)`` gives (``clip``: the strategy's ``gradient_clip_val``), step.
    Returns the summed metrics (with ``actor/grad_norm``, ``actor/lr``) and the policy parameters
    the step changed. ``clip_fn(params, max_norm) -> norm`` replaces :func:`clip_gradients` (e.g. to reduce gradients
    across data-parallel ranks and take a tensor-parallel norm first); ``runner`` replaces
    :func:`run_micro_batches` (e.g. megatron's forward-backward schedule). With
    ``grads_into_parameters`` (models whose parameters are plain leaves, e.g. the ``single``
    strategy's) the LM head and the input embedding add their gradients straight into ``.grad``
    (:func:`rltrainer.lm_head.gradients_into_parameters`)."""
    for m in models:
        m.train()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)

    def step(mb: RolloutBatch) -> Any:
        release_free_heap()  # what the previous micro-batch's forward and backward freed (rltrainer.allocator)
        with autocast_factory():
            out = check_hook_result(module, "policy_step", module.policy_step(mb))
        return zero_padding(mb, out)

    with gradients_into_parameters() if grads_into_parameters else contextlib.nullcontext():
        outputs = runner(step, micro_batches, True)
    totals = combine_metrics({k: v.detach().float() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
                             for _, metrics in outputs)
    for opt in optimizers:
        module.on_before_optimizer_step(opt)
    max_norm = check_float(f"{type(module).__name__}.gradient_clip_norm()", module.gradient_clip_norm(clip), above=0,
                           none="no clipping", meaning="the norm this step clips the gradients to")
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    grad_norm = (clip_fn or clip_gradients)(params, max_norm)
    out = {k: v.cpu() if isinstance(v, torch.Tensor) and v.dim() else float(v) for k, v in totals.items()}
    out["actor/grad_norm"] = grad_norm
    out["actor/lr"] = optimizers[0].param_groups[0]["lr"]
    stepped: list[str] = []
    if math.isfinite(grad_norm):
        stepped = stepped_parameter_names(module.policy.named_parameters())
        for opt in optimizers:
            opt.step()
        for sched in schedulers:
            sched.step()
    else:
        log.warning("Non-finite gradient norm (%s): optimizer step skipped", grad_norm)
    release_free_heap()
    return out, stepped


def zero_padding(micro_batch: RolloutBatch, out: tuple[torch.Tensor, dict[str, Any]]) -> tuple[torch.Tensor, dict[str, Any]]:
    """A padding micro-batch's ``policy_step`` output with its contribution removed: the loss times 0
    (the backward still runs, so a rank short of rows joins every collective, but adds no gradient,
    even from a loss that ignores ``response_mask``) and no metrics. Other micro-batches as they are."""
    if not micro_batch.padding:
        return out
    loss, _ = out
    return loss * 0.0, {}


def combine_metrics(parts: Any) -> dict[str, Any]:
    """Combine ``policy_step`` metrics over micro-batches (or ranks): a name ending in ``_max`` or
    ``/max`` takes the largest value, one ending in ``_min`` or ``/min`` the smallest, every other
    adds up (each part is already its share of the global count, see
    :func:`~rltrainer.algorithms.aggregation.masked_sum_over`). A name missing from a part is
    skipped there. A tensor with dimensions (counts, e.g. a MoE policy's tokens per expert and
    layer) adds up element by element and is summarised into numbers after the update
    (:func:`rltrainer.models.moe.summarize_routing_metrics`)."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v
            elif k.endswith(("_max", "/max")):
                out[k] = max(out[k], v)  # numbers or 0-dim tensors
            elif k.endswith(("_min", "/min")):
                out[k] = min(out[k], v)
            else:
                out[k] = out[k] + v
    return out


def is_extreme(name: str) -> bool:
    """Whether :func:`combine_metrics` reduces ``name`` by max or min instead of a sum."""
    return name.endswith(("_max", "/max", "_min", "/min"))


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip to ``max_norm`` (if set) and return the total norm before clipping (global across
    ranks for sharded DTensor parameters)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def local_training_state(module: RLModule, optimizers: list[Any], schedulers: list[Any]) -> dict[str, Any]:
    """This process's models, optimizers and schedulers, as saved in a checkpoint."""
    return {"models": {name: m.state_dict() for name, m in module.trainable_models().items()},
            "optimizers": [opt.state_dict() for opt in optimizers],
            "schedulers": [s.state_dict() for s in schedulers]}


def load_local_training_state(module: RLModule, optimizers: list[Any], schedulers: list[Any],
                              state: dict[str, Any], source: str = "The checkpoint", optimizer: bool = True) -> None:
    """The inverse of :func:`local_training_state`; a model whose names or shapes differ from the
    saved ones raises :class:`~rltrainer.checkpoints.CheckpointError` (``source``: where it came from).
    Without ``optimizer`` the optimizers start afresh instead (:func:`reset_optimizer`)."""
    models = module.trainable_models()
    saved = state.get("models", {}) if isinstance(state, dict) else {}
    if set(saved) != set(models):
        raise CheckpointError(f"{source} holds the models {sorted(saved)}; this module trains {sorted(models)}.")
    for name, m in models.items():
        check_state_matches(f"{source} ({name})", shapes(m.state_dict()), shapes(saved[name]))
    if optimizer and len(state["optimizers"]) != len(optimizers):
        raise CheckpointError(f"{source} holds {len(state['optimizers'])} optimizer(s); configure_optimizers() "
                              f"returned {len(optimizers)}.")
    for name, m in models.items():
        m.load_state_dict(saved[name])
    if optimizer:
        for opt, s in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(s)
    else:
        for opt in optimizers:
            reset_optimizer(opt)
    for sched, s in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(s)


def reset_optimizer(optimizer: Any) -> None:
    """``optimizer`` as if it had not stepped: its state (moments, step count) dropped, its param
    groups' hyperparameters as they are. A torch optimizer clears ``state``; one that keeps more
    (megatron's, :meth:`~rltrainer.strategies.megatron.optimizer.MegatronOptimizer.reset_state`)
    resets it its own way."""
    reset = getattr(optimizer, "reset_state", None)
    if reset is not None:
        reset()
    else:
        optimizer.state.clear()


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


#: Trainer arguments that configure a strategy built from its name, with the Trainer's defaults.
STRATEGY_SETTINGS = {"precision": "32-true", "gradient_clip_val": 1.0}


def resolve_strategy(strategy: str | Strategy, devices: int | str, num_nodes: int, **settings: Any) -> Strategy:
    """The strategy named ``strategy`` built with the Trainer's ``settings`` (those left at
    :data:`STRATEGY_SETTINGS`' defaults are the strategy's own), or the instance, checked against them."""
    changed = {k: v for k, v in settings.items() if v != STRATEGY_SETTINGS[k]}
    if isinstance(strategy, Strategy):
        for name, value in changed.items():
            if getattr(strategy, name) != value:
                raise ValueError(f"Trainer({name}={value!r}) conflicts with the strategy's own {name}="
                                 f"{getattr(strategy, name)!r}; set it in one place (the Strategy's argument, or "
                                 f"the Trainer's with strategy given by name).")
        return strategy
    kwargs: dict[str, Any] = {"devices": devices, "precision": settings["precision"], **changed}
    if num_nodes != 1:
        kwargs["num_nodes"] = num_nodes
    return build_strategy(strategy, **kwargs)
