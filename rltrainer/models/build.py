"""Build transformers causal LMs: from a hub id, a path, a config or a callable
(:func:`build_causal_lm`), frozen copies, and the deferred build sharded strategies use.

A strategy that shards (FSDP2, Megatron) builds the models inside :func:`deferred_init`: their
parameters stay on the meta device, and each records where its values come from
(:func:`take_weight_source`), so every rank reads or receives only its own part once the model is
sharded.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from rltrainer.lora import base_name
from rltrainer.models.checkpoint_form import ConvertedWeights, converted_weights
from rltrainer.models.safetensors_io import SafetensorsWeights, find_tensor
from rltrainer.models.support import config_problem
from rltrainer.process_groups import host_group

ModelSpec = str | Any | Callable[[], torch.nn.Module]


def build_causal_lm(spec: ModelSpec, dtype: torch.dtype | None = None, seed: int | None = None) -> torch.nn.Module:
    """A causal LM from a hub id or local path, a transformers ``PretrainedConfig`` (random
    init; ``seed`` makes it reproducible), or a zero-argument callable returning a model.

    Inside :func:`deferred_init` a hub id, path or config gives a model whose parameters are on
    the meta device, with its :class:`SafetensorsWeights` or :class:`RandomInit` attached; a
    callable's model is built as it builds it."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        problem = config_problem(spec)
        if problem is not None:  # transformers' own error lists every config it builds
            raise ValueError(f"model={type(spec).__name__}(...): the {problem}")
        if seed is not None:
            torch.manual_seed(seed)
        config = copy.deepcopy(spec)
        config.use_cache = False
        return init_from_config(config, dtype)
    if isinstance(spec, str):
        return load_pretrained(spec, AutoModelForCausalLM, dtype)
    if callable(spec):
        return spec()
    raise TypeError(
        f"model must be a hub id or path (str), a transformers PretrainedConfig, or a callable "
        f"returning a model; got {type(spec).__name__}"
    )


def load_pretrained(spec: str, auto_class: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``auto_class.from_pretrained(spec)``; inside :func:`deferred_init`, the same model built on the
    meta device with the checkpoint's safetensors attached."""
    if _DEFERRED.get() is None:
        return auto_class.from_pretrained(spec, dtype=dtype) if dtype else auto_class.from_pretrained(spec)
    return _checkpoint_on_meta(spec, dtype, auto_class)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with gradients off and in eval mode (a reference model). A model built on the
    meta device copies as one (no memory) and shares its weight source."""
    return freeze(copy.deepcopy(model))


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with gradients off and in eval mode (a reference model, a teacher, a reward model)."""
    model.requires_grad_(False)
    return model.eval()


# -- building on the meta device, loading each rank's part -------------------------------------------
_DEFERRED: ContextVar[bool | None] = ContextVar("rltrainer_deferred_init", default=None)
_SOURCE_ATTR = "_rltrainer_weight_source"


@contextlib.contextmanager
def deferred_init(init_random_here: bool) -> Iterator[None]:
    """Inside it, :func:`build_causal_lm` builds parameters on the meta device (buffers such as
    RoPE frequencies stay real: they are computed, not loaded) and attaches where their values come
    from: a checkpoint's safetensors files (:class:`SafetensorsWeights`), or, for a config, the
    random init (:class:`RandomInit`), which runs in full only where ``init_random_here`` (one
    process, which then sends each rank its part). Outside it, nothing changes."""
    token = _DEFERRED.set(init_random_here)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def take_weight_source(model: torch.nn.Module) -> WeightSource | None:
    """The weight source :func:`build_causal_lm` attached to ``model`` (``None`` if none), detached
    from it so that its memory goes once the strategy has loaded every model sharing it."""
    return model.__dict__.pop(_SOURCE_ATTR, None)


class RandomInit:
    """The random init of a config: ``state`` holds the full tensors where they were initialised
    (one process), ``None`` elsewhere; :meth:`find`, :meth:`shape` and :meth:`read` answer there."""

    def __init__(self, state: dict[str, torch.Tensor] | None) -> None:
        self.state = state

    def __deepcopy__(self, memo: dict[int, Any]) -> RandomInit:
        return self  # a frozen_copy starts from the same weights

    def find(self, aliases: list[str]) -> str:
        return find_tensor(aliases, self.state or {}, "the random init")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple((self.state or {})[name].shape)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor = (self.state or {})[name]
        return tensor[start:stop] if tensor.dim() else tensor


def init_from_config(config: Any, dtype: torch.dtype | None = None, auto_class: Any = None) -> torch.nn.Module:
    """``auto_class.from_config(config)`` (default ``AutoModelForCausalLM``): a random init from the
    torch RNG as it stands. Inside :func:`deferred_init` the model is on the meta device with its
    :class:`RandomInit` attached, and only the process that initialises draws it (the same draws,
    so the same weights, as without deferral); the others keep the structure only."""
    deferred = _DEFERRED.get()
    if deferred is None:
        return _from_config(config, dtype, auto_class)
    state = {n: p.detach() for n, p in _from_config(config, dtype, auto_class).named_parameters()} if deferred else None
    return _with_source(_from_config(config, dtype, auto_class, meta=True), RandomInit(state))


WeightSource = SafetensorsWeights | ConvertedWeights | RandomInit  # where a deferred model's weights come from


def source_key(source: WeightSource, aliases: list[str], shape: tuple[int, ...]) -> str:
    """The tensor of ``source`` holding a parameter (``aliases``: its names, tied ones included) of
    shape ``shape``; raises, naming the tensor, if there is none or it has another shape."""
    key = source.find(aliases)
    if source.shape(key) != shape:
        where = getattr(source, "path", "the random init")
        raise ValueError(f"{where}: tensor {key!r} has shape {list(source.shape(key))}, but the model built from its "
                         f"config has {list(shape)} there. The checkpoint's tensors must match its config.json.")
    return key


def share_rng_state() -> None:
    """Every rank takes rank 0's torch RNG state: rank 0 alone drew the random init, where without
    deferral every rank drew the same (so colocated engines sample as before). A collective."""
    import torch.distributed as dist

    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0, group=host_group())
    torch.set_rng_state(state[0])


def parameter_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's name -> all its names (a tied weight has several), first the one
    ``named_parameters()`` gives."""
    # a LoRA policy's base weights load from the plain names (base_name)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).extend(dict.fromkeys([name, base_name(name)]))
    return {name: names[id(param)] for name, param in model.named_parameters()}


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that make up ``model``'s weights, by name: its parameters (a tied one once, as
    ``named_parameters`` gives it), then the buffers its checkpoint stores (persistent ones, e.g.
    DeepSeek-V3's router ``e_score_correction_bias``; not RoPE tables, which are computed). What
    weight sync sends and the HF export writes: an engine or a reloaded model built from the config
    would otherwise keep its own initial value of such a buffer."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    for owner, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                tensors[f"{owner}.{leaf}" if owner else leaf] = buffer
    return tensors


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of :func:`state_tensors`."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in state_tensors(model).items() if name not in params}


def _from_config(config: Any, dtype: torch.dtype | None, auto_class: Any = None, meta: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    auto = auto_class or AutoModelForCausalLM
    with _parameters_on_meta() if meta else contextlib.nullcontext():
        return auto.from_config(config, dtype=dtype) if dtype else auto.from_config(config)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (its CPU allocation is never
    touched, so never resident); buffers are left as built."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _with_source(model: torch.nn.Module, source: WeightSource) -> torch.nn.Module:
    model.__dict__[_SOURCE_ATTR] = source
    return model


def _checkpoint_on_meta(spec: str, dtype: torch.dtype | None, auto_class: Any = None) -> torch.nn.Module:
    """``from_pretrained(spec)``'s model, built on the meta device, with its safetensors attached."""
    from transformers import AutoConfig

    path = _checkpoint_dir(spec)
    weights = SafetensorsWeights(path)
    config = AutoConfig.from_pretrained(path)
    dtype = dtype or getattr(config, "dtype", None) or weights.dtype()  # from_pretrained's dtype="auto"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = _from_config(config, dtype, auto_class, meta=True).eval()  # from_pretrained returns eval()
    return _with_source(model, converted_weights(weights, model))  # experts stored one by one: as loaded


def _checkpoint_dir(spec: str) -> str:
    """A local directory as given; a hub id's snapshot (config and safetensors only) otherwise."""
    if os.path.isdir(os.path.expanduser(spec)):
        return os.path.expanduser(spec)
    if os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise FileNotFoundError(f"model={spec!r} is not a directory. Give a model directory (config.json and "
                                "*.safetensors files) or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'.")
    from huggingface_hub import snapshot_download

    return snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"])
