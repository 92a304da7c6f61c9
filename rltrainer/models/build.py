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
import glob
import json
import math
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from rltrainer.lora import base_name

ModelSpec = str | Any | Callable[[], torch.nn.Module]


def build_causal_lm(spec: ModelSpec, dtype: torch.dtype | None = None, seed: int | None = None) -> torch.nn.Module:
    """A causal LM from a hub id or local path, a transformers ``PretrainedConfig`` (random
    init; ``seed`` makes it reproducible), or a zero-argument callable returning a model.

    Inside :func:`deferred_init` a hub id, path or config gives a model whose parameters are on
    the meta device, with its :class:`SafetensorsWeights` or :class:`RandomInit` attached; a
    callable's model is built as it builds it."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
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
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


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


def take_weight_source(model: torch.nn.Module) -> SafetensorsWeights | RandomInit | None:
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
        return _find(aliases, self.state or {}, "the random init")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple((self.state or {})[name].shape)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor = (self.state or {})[name]
        return tensor[start:stop] if tensor.dim() else tensor


class SafetensorsWeights:
    """The ``*.safetensors`` files of a model directory. :meth:`read` reads rows of one tensor with
    plain file reads, straight into the destination when it can: only those bytes are read, and no
    file is memory-mapped (mapped pages would count in the process's resident memory)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            present = sorted(os.listdir(path))
            raise FileNotFoundError(
                f"{path} holds no *.safetensors file (it has: {', '.join(present[:12]) or 'nothing'}"
                f"{', ...' if len(present) > 12 else ''}). Sharded strategies load a checkpoint from its safetensors "
                "files only: save it with save_pretrained(path) (safetensors is its default), or convert its "
                "*.bin / *.pt files.")
        self._entries: dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]] | None = None
        self.bytes_read = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> SafetensorsWeights:
        return self

    def names(self) -> dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]]:
        """Tensor name -> (file, offset of its first byte, dtype, shape), from the files' headers."""
        if self._entries is None:
            self._entries = {}
            for file in self.files:
                with open(file, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
                for name, entry in header.items():
                    if name == "__metadata__":
                        continue
                    if entry["dtype"] not in _SAFETENSORS_DTYPES:
                        raise ValueError(f"{file}: tensor {name!r} has dtype {entry['dtype']}; readable dtypes are "
                                         f"{', '.join(_SAFETENSORS_DTYPES)}")
                    self._entries[name] = (file, 8 + size + entry["data_offsets"][0],
                                           _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]))
        return self._entries

    def find(self, aliases: list[str]) -> str:
        """The first of ``aliases`` (a parameter's names, tied ones included) in the checkpoint."""
        return _find(aliases, self.names(), self.path)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.names()[name][3]

    def dtype(self) -> torch.dtype | None:
        """The first floating tensor's dtype (transformers' ``dtype="auto"`` when config.json has none)."""
        return next((e[2] for e in self.names().values() if e[2].is_floating_point), None)

    def read(self, name: str, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (all by default), into ``out`` if given (cast and
        moved as needed; read in place when it is a contiguous CPU tensor of the file's dtype)."""
        file, offset, dtype, shape = self.names()[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        stop = (shape[0] if shape else 1) if stop is None else stop
        rows = (stop - start, *shape[1:]) if shape else ()
        direct = out is not None and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(rows, dtype=dtype)
        buffer = memoryview(target.view(-1).view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
        with open(file, "rb", buffering=0) as f:
            f.seek(offset + start * row)
            done = 0
            while done < len(buffer):  # large reads may return short
                got = f.readinto(buffer[done:])
                if not got:
                    raise ValueError(f"{file} ends inside tensor {name!r}: the file is truncated")
                done += got
        self.bytes_read += len(buffer)
        if out is not None and not direct:
            return out.copy_(target)
        return target


def _find(aliases: list[str], names: Any, where: str) -> str:
    for name in aliases:
        if name in names:
            return name
    some = ", ".join(sorted(names)[:6])
    raise KeyError(f"{where} has no tensor {' or '.join(map(repr, aliases))}, which the model built from its config "
                   f"needs; it holds {len(names)} tensors ({some}, ...). Is it a checkpoint of this architecture?")


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


def source_key(source: SafetensorsWeights | RandomInit, aliases: list[str], shape: tuple[int, ...]) -> str:
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
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])


def parameter_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's name -> all its names (a tied weight has several), first the one
    ``named_parameters()`` gives."""
    # a LoRA policy's base weights load from the plain names (base_name)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).extend(dict.fromkeys([name, base_name(name)]))
    return {name: names[id(param)] for name, param in model.named_parameters()}


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


def _with_source(model: torch.nn.Module, source: SafetensorsWeights | RandomInit) -> torch.nn.Module:
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
    return _with_source(_from_config(config, dtype, auto_class, meta=True).eval(), weights)  # from_pretrained returns eval()


def _checkpoint_dir(spec: str) -> str:
    """A local directory as given; a hub id's snapshot (config and safetensors only) otherwise."""
    if os.path.isdir(os.path.expanduser(spec)):
        return os.path.expanduser(spec)
    if os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise FileNotFoundError(f"model={spec!r} is not a directory. Give a model directory (config.json and "
                                "*.safetensors files) or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'.")
    from huggingface_hub import snapshot_download

    return snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"])
