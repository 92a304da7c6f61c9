"""megatron-core's gradient reduction and optimizer for the module's trainable models.

Each trainable model is wrapped in megatron-core's ``DistributedDataParallel`` (contiguous gradient
buffers, bucketed reduce-scatter / all-reduce over the data-parallel group, finished by
``finalize_model_grads``, which also adds the tied embedding's two copies across pipeline stages).
The torch optimizers ``configure_optimizers()`` returned become one megatron-core optimizer
(``get_megatron_optimizer``; the distributed optimizer by default: each data-parallel rank steps
its shard of the parameters, then an all-gather brings every rank the updated ones), with each
user param group's hyperparameters; the user's LR schedulers are rebound to those groups.

:class:`MegatronOptimizer` is what the shared training step (``run_train_step``) sees as the one
optimizer of the rank: ``zero_grad``, ``param_groups`` (for ``actor/lr``), ``step``,
``state_dict`` / ``load_state_dict``; :meth:`MegatronOptimizer.clip` is the worker's
``clip_gradients``: megatron's global gradient norm and clipping.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from rltrainer.strategies.megatron.cpu import cpu_placement
from rltrainer.strategies.megatron.models import MegatronCausalLM

#: The key each megatron param group carries: ``(optimizer index, group index)`` of the user's
#: param group it was built from (``configure_optimizers()`` order).
GROUP_TAG = "rltrainer_group"

#: Per-group hyperparameters copied from the user's param groups into megatron's.
_HYPERPARAMETERS = {"adam": ("lr", "initial_lr", "betas", "eps", "weight_decay"),
                    "sgd": ("lr", "initial_lr", "momentum", "dampening", "nesterov", "weight_decay")}

_SUPPORTED = ("torch.optim.AdamW and torch.optim.Adam (lr, betas, eps, weight_decay per param group), and "
              "torch.optim.SGD (lr, momentum, dampening, nesterov, weight_decay) with "
              "use_distributed_optimizer=False")


def ddp_target(model: torch.nn.Module) -> torch.nn.Module:
    """The module megatron's DDP wraps for a placed model: a policy's ``GPTModel`` (megatron finds
    its ``pre_process`` / shared embedding through DDP's ``.module``), a critic whole (trunk, norm
    and score head)."""
    return model.gpt if isinstance(model, MegatronCausalLM) else model


def wrap_in_ddp(models: dict[str, torch.nn.Module], options: dict[str, Any]) -> dict[str, Any]:
    """megatron-core ``DistributedDataParallel`` around each model (its parameters move into the
    DDP's contiguous buffers; the model itself is called as before)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=options["grad_reduce_in_fp32"], overlap_grad_reduce=options["overlap_grad_reduce"],
        use_distributed_optimizer=options["use_distributed_optimizer"], bucket_size=options["ddp_bucket_size"],
        average_in_collective=False)  # summed: the hooks' losses are normalised by global counts
    # one config for all (megatron's distributed optimizer asserts its chunks' configs are equal)
    return {name: DistributedDataParallel(m.gpt.config, ddp_config, ddp_target(m)) for name, m in models.items()}


def _kind(optimizer: torch.optim.Optimizer) -> str:
    """``"adam"`` or ``"sgd"``: which megatron optimizer translates ``optimizer``."""
    if type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        bad = [k for k in ("amsgrad", "maximize") if any(g.get(k) for g in optimizer.param_groups)]
    elif type(optimizer) is torch.optim.SGD:
        bad = [k for k in ("maximize",) if any(g.get(k) for g in optimizer.param_groups)]
    else:
        raise TypeError(f"strategy='megatron' cannot translate {type(optimizer).__module__}."
                        f"{type(optimizer).__qualname__} from configure_optimizers() into megatron-core's optimizer; "
                        f"it translates {_SUPPORTED}. Return one of those from configure_optimizers().")
    if bad:
        raise ValueError(f"strategy='megatron' cannot translate {type(optimizer).__name__}({bad[0]}=True) into "
                         f"megatron-core's optimizer; it translates {_SUPPORTED}. Set {bad[0]}=False.")
    return "adam" if type(optimizer) is not torch.optim.SGD else "sgd"


def _decoupled(optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether an Adam's weight decay is decoupled (AdamW); ``None`` where it has none to apply."""
    if all(g.get("weight_decay", 0.0) == 0 for g in optimizer.param_groups):
        return None
    return bool(optimizer.param_groups[0].get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))


def optimizer_config(optimizers: list[torch.optim.Optimizer], options: dict[str, Any]) -> Any:
    """megatron-core's ``OptimizerConfig`` for the user's optimizers (their per-group
    hyperparameters are set on megatron's groups afterwards, see :func:`copy_hyperparameters`)."""
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER, OptimizerConfig

    kinds = {_kind(opt) for opt in optimizers}
    if len(kinds) > 1:
        raise ValueError("strategy='megatron' steps all of configure_optimizers()'s optimizers with one megatron-core "
                         f"optimizer; they must all be Adam(W) or all SGD, got {sorted(kinds)}")
    kind, distributed = kinds.pop(), options["use_distributed_optimizer"]
    if kind == "sgd" and distributed:
        raise ValueError("megatron-core's distributed optimizer steps Adam only (distrib_optimizer.py asserts it); "
                         "for torch.optim.SGD pass MegatronStrategy(use_distributed_optimizer=False)")
    modes = {_decoupled(opt) for opt in optimizers} - {None}
    if len(modes) > 1:
        raise ValueError("strategy='megatron' steps all optimizers with one megatron-core Adam: they must all decouple "
                         "weight decay (AdamW) or all not (Adam with weight_decay); got both")
    decoupled = modes.pop() if modes else True
    if kind == "adam" and not decoupled and distributed and USING_PYTORCH_OPTIMIZER:
        raise ValueError("torch.optim.Adam with weight_decay > 0 (L2, not decoupled) needs Transformer Engine's or "
                         "apex's FusedAdam under megatron-core's distributed optimizer, and neither is installed: use "
                         "torch.optim.AdamW, or MegatronStrategy(use_distributed_optimizer=False)")
    first = optimizers[0].param_groups[0]
    betas = first.get("betas", (0.9, 0.999))
    bf16 = options["precision"] == "bf16-true"
    return OptimizerConfig(
        optimizer=kind, lr=float(first["lr"]), weight_decay=float(first.get("weight_decay", 0.0)),
        adam_beta1=float(betas[0]), adam_beta2=float(betas[1]), adam_eps=float(first.get("eps", 1e-8)),
        sgd_momentum=float(first.get("momentum", 0.0)), decoupled_weight_decay=decoupled,
        clip_grad=float(options["gradient_clip_val"] or 0.0), bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=distributed)


def group_overrides(optimizers: list[torch.optim.Optimizer], chunks: list[Any]) -> dict[Any, Any]:
    """One megatron param group per user param group: each parameter is tagged with the
    ``(optimizer, group)`` that holds it (:data:`GROUP_TAG`). Raises if a trainable parameter is in
    no optimizer, or in two."""
    from megatron.core.optimizer import ParamKey
    from megatron.core.optimizer.optimizer_config import ParamPredicate

    owner: dict[int, tuple[int, int]] = {}
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) in owner:
                    raise ValueError(f"A parameter is in optimizer {owner[id(p)][0]} group {owner[id(p)][1]} and in "
                                     f"optimizer {i} group {j} of configure_optimizers(); give each parameter to one")
                owner[id(p)] = (i, j)
    unowned = [n for c in chunks for n, p in c.module.named_parameters() if p.requires_grad and id(p) not in owner]
    if unowned:
        raise ValueError(f"Parameters {unowned[:4]} require grad but no optimizer from configure_optimizers() holds "
                         "them: add them to an optimizer, or freeze them (requires_grad_(False)) in configure_model")
    overrides = {}
    for tag in sorted(set(owner.values())):
        ids = frozenset(k for k, v in owner.items() if v == tag)
        key = ParamKey(predicate=ParamPredicate(name=f"{GROUP_TAG}{tag}", fn=lambda p, ids=ids: id(p) in ids))
        overrides[key] = {GROUP_TAG: tag}
    return overrides


def copy_hyperparameters(groups: list[dict[str, Any]], optimizers: list[torch.optim.Optimizer], kind: str) -> None:
    """Set each megatron group's lr (current and ``initial_lr``, as the user's schedulers left them),
    betas, eps, weight decay (SGD: momentum, dampening, nesterov) from the user group it was built from."""
    for group in groups:
        i, j = group[GROUP_TAG]
        source = optimizers[i].param_groups[j]
        group.update({k: source[k] for k in _HYPERPARAMETERS[kind] if k in source})


class UserGroups:
    """What a user's LR scheduler steps once rebound (``scheduler.optimizer = UserGroups(...)``):
    the megatron param groups built from user optimizer ``index``, in that optimizer's order. Looked
    up on each access, so a checkpoint load (which rebuilds the groups) keeps them bound."""

    def __init__(self, megatron: Any, index: int, user: torch.optim.Optimizer) -> None:
        self.megatron, self.index, self.user = megatron, index, user
        self._opt_called = False  # torch's scheduler warns on its first step unless the optimizer stepped

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """A user group with no trainable parameter on any rank has no megatron group: its own
        (stepped by nothing) stands in, so that the scheduler's per-group lists keep their length."""
        by_tag = {g[GROUP_TAG]: g for g in self.megatron.param_groups}
        return [by_tag.get((self.index, j), group) for j, group in enumerate(self.user.param_groups)]

    def step(self) -> None:
        """Called by :meth:`MegatronOptimizer.step` after megatron's step (the scheduler checks it)."""
        self._opt_called = True

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # what torch's scheduler looks for


class MegatronOptimizer:
    """The rank's DDP-wrapped models and their megatron-core optimizer, seen by ``run_train_step``
    as the one optimizer of the rank.

    Args:
        models: the trainable placed models (``policy``, ``critic``), by name.
        optimizers / schedulers: what ``configure_optimizers()`` returned (``normalize_optimizers``).
        options: the strategy's options (``use_distributed_optimizer``, ``overlap_grad_reduce``,
            ``grad_reduce_in_fp32``, ``ddp_bucket_size``, ``gradient_clip_val``, ``precision``).
        device: the rank's device (on a CPU, megatron's CUDA placements become CPU ones).
    """

    def __init__(self, models: dict[str, torch.nn.Module], optimizers: list[torch.optim.Optimizer],
                 schedulers: list[Any], options: dict[str, Any], device: torch.device) -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        self.device, self.stepped = device, False
        self.config = config = optimizer_config(optimizers, options)  # raises before anything is wrapped
        with self._placement():
            self.ddps = wrap_in_ddp(models, options)
            chunks = list(self.ddps.values())
            self.megatron = get_megatron_optimizer(config, chunks, config_overrides=group_overrides(optimizers, chunks))
        copy_hyperparameters(self.megatron.param_groups, optimizers, config.optimizer)
        self.views = [UserGroups(self.megatron, i, opt) for i, opt in enumerate(optimizers)]
        for sched in schedulers:
            index = next((i for i, opt in enumerate(optimizers) if sched.optimizer is opt), None)
            if index is None:
                raise ValueError(f"The LR scheduler {type(sched).__name__} from configure_optimizers() steps an "
                                 "optimizer configure_optimizers() did not return: build it on one of those")
            for bound in (sched, *getattr(sched, "_schedulers", ())):  # SequentialLR / ChainedScheduler's parts too
                bound.optimizer = self.views[index]

    def _placement(self) -> contextlib.AbstractContextManager:
        return cpu_placement(self.device, type_names=True)

    # -- the forward-backward schedule's hooks (config.no_sync_func / finalize_model_grads_func) ---------
    def attach(self, config: Any) -> None:
        """Set the schedule's gradient hooks on the ``TransformerConfig`` it reads (as megatron's
        training loop does): no gradient reduction before the last micro-batch, then
        :meth:`finalize`. ``grad_sync_func`` stays unset (megatron's ``align_grad_reduce=False``):
        with ``overlap_grad_reduce`` each stage launches its bucket reductions from the backward
        hooks of its last micro-batch."""
        config.no_sync_func = self.no_sync
        config.finalize_model_grads_func = self.finalize

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for ddp in self.ddps.values():
                stack.enter_context(ddp.no_sync())
            yield

    def finalize(self, model: Any, num_tokens: Any = None, pg_collection: Any = None,
                 force_all_reduce: bool = False) -> None:
        """megatron's ``finalize_model_grads`` over every DDP-wrapped model (the schedule passes its
        own ``[model]``, the pipeline slot): the data-parallel reduction, then the tied embedding's
        all-reduce across pipeline stages. Gradients are summed, not divided by a token count
        (``num_tokens=None``): the hooks' losses are normalised by global counts already."""
        from megatron.core.distributed import finalize_model_grads

        with self._placement():
            finalize_model_grads(list(self.ddps.values()), num_tokens=None, force_all_reduce=force_all_reduce)

    # -- what run_train_step calls ---------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """megatron's param groups, one per user param group, in ``configure_optimizers()`` order
        (``run_train_step`` reports the first one's lr as ``actor/lr``). They are the dicts
        megatron-core's inner torch optimizers step with (a megatron optimizer's ``param_groups``
        is its inner optimizer's, ``megatron/core/optimizer/optimizer.py:290-299``, chained at
        ``optimizer.py:1118-1123``), so a hyperparameter set here (in ``on_before_optimizer_step``)
        is the one the next :meth:`step` uses."""
        return [group for view in self.views for group in view.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        with self._placement():
            for ddp in self.ddps.values():
                ddp.zero_grad_buffer()
            self.megatron.zero_grad(set_to_none)
        self.stepped = False

    def clip(self, max_norm: float | None) -> float:
        """megatron's global gradient norm (over data-parallel shards, tensor-parallel slices and
        pipeline stages; a tied embedding's second copy not counted), and clipping to ``max_norm``
        if it is finite: ``ChainedOptimizer.step`` up to its inner step, which :meth:`step` runs
        (split so that a non-finite norm skips the step, as on every strategy). ``max_norm`` is the
        step's own (the module's ``gradient_clip_norm``): megatron-core reads its config's
        ``clip_grad`` only in its ``step()`` (``optimizer.py:606-607, 976-977, 1323-1329``), never
        in the ``step_with_ready_grads`` that :meth:`step` calls (``optimizer.py:559-590, 942-958,
        1241-1252``, ``distrib_optimizer.py:2597-2623``), so nothing clips a second time."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        with self._placement():
            if self.megatron.prepare_grads():  # found inf/nan (only with an fp16 loss scaler)
                return float("nan")
            norm = float(self.megatron.get_grad_norm())
            if max_norm and math.isfinite(norm):
                for opt in self.megatron.chained_optimizers:
                    params = opt.get_parameters()
                    if params and not getattr(opt, "is_stub_optimizer", False):
                        decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                        clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm,
                                                     use_decoupled_grad=decoupled)
        return norm

    def step(self) -> None:
        """megatron's inner step (and, with the distributed optimizer, the all-gather of the updated
        parameters into every rank's model)."""
        with self._placement():
            self.megatron.step_with_ready_grads()
        for view in self.views:
            view.step()
        self.stepped = True

    # -- checkpoints: this rank's shard ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each megatron optimizer's state on this rank (the distributed optimizer's: its param
        groups and step, plus this rank's shard of main parameters and moments, megatron's
        ``dp_reshardable`` layout), and every group's hyperparameters in order."""
        with self._placement():
            parts = [_optimizer_state(opt) for opt in self.megatron.chained_optimizers]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.megatron.param_groups]
        return {"groups": groups, "optimizers": parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # no_grad: with fp32 parameters the main-parameter shards megatron copies into are views of
        # the (grad-requiring) model parameters (distrib_optimizer.py:420-421, 940)
        with self._placement(), torch.no_grad():
            for opt, part in zip(self.megatron.chained_optimizers, state["optimizers"]):
                if part is not None:
                    opt.load_state_dict(_with_padding_flags(part))
                    _unshare_steps(opt)
        # megatron matches loaded groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), alike
        # for every group here: put each group's own hyperparameters (and tag) back, in order
        for group, saved in zip(self.megatron.param_groups, state["groups"], strict=True):
            group.update(saved)

    # -- checkpoints in any layout (rltrainer.strategies.megatron.checkpoint) ---------------------------------
    def state_slots(self) -> dict[int, tuple[Any, torch.Tensor, slice | None]]:
        """Where the optimizer state of each model parameter on this rank lives, by ``id(param)``:
        ``(torch optimizer, main parameter, elements)``: the torch optimizer's state is keyed by the
        main parameter (the parameter itself, or its fp32 copy for a bf16 one), and with the
        distributed optimizer holds ``elements`` of the flattened parameter (``None``: all of it).
        A parameter of which this rank steps nothing (a data-parallel shard elsewhere) is absent."""
        from megatron.core.optimizer import DistributedOptimizer

        slots: dict[int, tuple[Any, torch.Tensor, slice | None]] = {}
        for opt in self.megatron.chained_optimizers:
            inner = opt.optimizer
            if isinstance(opt, DistributedOptimizer):
                # each group's model parameters beside their main shards, by dtype: a group's inner
                # params list its fp32 shards first, then the bf16 ones' fp32 copies
                # (distrib_optimizer.py:440-444), so a group holding both (bf16-true with fp32 norms)
                # does not follow model_param_group_index_map's order
                pairs = [*zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                         *zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
                for models, mains in pairs:
                    for param, main in zip(models, mains, strict=True):
                        elements = opt._get_model_param_range_map(param)["param"]
                        slots[id(param)] = (inner, main, slice(elements.start, elements.end))
            elif hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params: fp32 copies
                pairs = [*zip(opt.float16_groups, opt.fp32_from_float16_groups), *zip(opt.fp32_from_fp32_groups,
                                                                                      opt.fp32_from_fp32_groups)]
                for models, mains in pairs:
                    slots.update({id(p): (inner, m, None) for p, m in zip(models, mains)})
            else:  # FP32Optimizer: the parameters themselves
                slots.update({id(p): (inner, p, None) for g in inner.param_groups for p in g["params"]})
        return slots

    def step_count(self) -> float:
        """Adam's step count on this rank, read wherever its torch optimizers keep it (see
        :func:`counts_steps_in_groups`): each parameter's ``state["step"]`` and each non-empty
        param group's ``"step"``; 0 before the first step. An optimizer with state but no count
        (SGD's momentum) counts 1."""
        inners = self.inner_optimizers()
        steps = [float(state["step"]) for inner in inners for state in inner.state.values() if "step" in state]
        steps += [float(group["step"]) for inner in inners for group in inner.param_groups
                  if group["params"] and "step" in group]  # FusedAdam counts no step for an empty group
        has_state = any(state for inner in inners for state in inner.state.values())
        return max(steps, default=1.0 if has_state else 0.0)

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside megatron's (one per chained optimizer that steps anything here)."""
        chained = self.megatron.chained_optimizers
        return [opt.optimizer for opt in chained if getattr(opt, "optimizer", None) is not None]

    def init_state(self, step: float, kinds: list[str]) -> None:
        """Give every parameter this rank steps the state its torch optimizer creates on its first
        step (zeros), ready to be filled, and set Adam's step count to ``step`` where the optimizer
        keeps it (:func:`counts_steps_in_groups`): a tensor in each parameter's state, or an
        integer in each param group."""
        adam = self.config.optimizer == "adam"
        for inner, main, _ in self.state_slots().values():
            state = inner.state[main]
            for kind in kinds:
                if not isinstance(state.get(kind), torch.Tensor):
                    state[kind] = torch.zeros_like(main, memory_format=torch.preserve_format)
            if adam and not counts_steps_in_groups(inner):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        if adam:
            for inner in filter(counts_steps_in_groups, self.inner_optimizers()):
                for group in inner.param_groups:  # all alike, as megatron aligns them (distrib_optimizer.py:676-682)
                    group["step"] = int(step)

    def reset_state(self) -> None:
        """Start afresh on the weights the models hold now (a weights-only checkpoint load), as
        before the first step: megatron-core's inner torch optimizers drop their state (moments,
        and the step count each parameter's state keeps, or, :func:`counts_steps_in_groups`, each
        param group), and a bf16 model's fp32 main parameters are copied from its parameters again
        (megatron-core's ``reload_model_params``, "when we load a model from a checkpoint without
        loading the optimizer", ``optimizer.py:251-265``: ``Float16OptimizerWithFloat16Params``
        copies at ``optimizer.py:781-787``, the distributed optimizer at
        ``distrib_optimizer.py:2541-2595``; fp32 parameters are their own main parameters,
        ``optimizer.py:995-996``). The param groups' hyperparameters stay as they are."""
        for inner in self.inner_optimizers():
            inner.state.clear()
            if counts_steps_in_groups(inner):
                for group in inner.param_groups:
                    group.pop("step", None)  # FusedAdam counts from 1 where a group has none
        with self._placement(), torch.no_grad():
            self.megatron.reload_model_params()
        self.stepped = False

    def group_hyperparameters(self) -> dict[tuple[int, int], dict[str, Any]]:
        """The user-facing hyperparameters of this rank's param groups, by user group (:data:`GROUP_TAG`)."""
        keys = _HYPERPARAMETERS[self.config.optimizer]
        return {tuple(g[GROUP_TAG]): {k: g[k] for k in keys if k in g} for g in self.megatron.param_groups}

    def load_group_hyperparameters(self, saved: dict[tuple[int, int], dict[str, Any]]) -> None:
        for group in self.megatron.param_groups:
            group.update(saved.get(tuple(group[GROUP_TAG]), {}))


def counts_steps_in_groups(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps Adam's step count in its param groups (``group["step"]``, an
    integer: Transformer Engine's and apex's ``FusedAdam``, which megatron-core steps with whenever
    either imports, ``megatron/core/optimizer/__init__.py:12-22``) rather than in each parameter's
    state (``state["step"]``, a tensor: torch's Adam and AdamW, which run torch's own ``step``).
    FusedAdam must not get a per-parameter ``step``: Transformer Engine's ``state_dict`` reads only
    the states it knows (``exp_avg``, ``exp_avg_sq``, ``master_param``) and raises on another."""
    return type(optimizer).step not in (torch.optim.Adam.step, torch.optim.AdamW.step)


def _optimizer_state(opt: Any) -> dict[str, Any] | None:
    """One megatron optimizer's state on this rank, detached copies (``None`` before its first step:
    megatron's ``state_dict`` needs the step count its state holds)."""
    from megatron.core.optimizer import DistributedOptimizer

    inner = getattr(opt, "optimizer", None)
    if inner is None or not inner.state:
        return None
    state = opt.state_dict()
    if isinstance(opt, DistributedOptimizer):
        state = {**state, "param_state": opt.get_parameter_state_dp_reshardable(),
                 "param_state_sharding_type": "dp_reshardable"}
    return _detached(state)


def _unshare_steps(opt: Any) -> None:
    """Without Transformer Engine or apex, megatron-core 0.16's distributed optimizer loads one
    ``step`` tensor into every parameter's state (distrib_optimizer.py:818-825), and torch's Adam
    increments each parameter's ``step`` in place: the next step would count it once per
    parameter. Give each parameter its own copy."""
    inner = getattr(opt, "optimizer", None)
    for param_state in (inner.state.values() if inner is not None else []):
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = param_state["step"].clone()


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _with_padding_flags(state: dict[str, Any]) -> dict[str, Any]:
    """megatron-core 0.16's ``get_parameter_state_dp_reshardable`` writes no ``padding`` flag, which
    its inverse ``load_parameter_state_from_dp_reshardable`` filters on (distrib_optimizer.py:
    942-975, 1790-1794); every entry it writes is a parameter: ``padding=False``."""
    if state.get("param_state_sharding_type") != "dp_reshardable":
        return state
    param_state = dict(state["param_state"])
    for key, by_dtype in param_state.items():
        if isinstance(key, int):
            param_state[key] = {dtype: [[{"padding": False, **entry} for entry in bucket] for bucket in buckets]
                                for dtype, buckets in by_dtype.items()}
    return {**state, "param_state": param_state}
