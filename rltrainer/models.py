"""Build transformers causal LMs, and the teacher-forced forward over response tokens.

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
import torch.nn.functional as F

from rltrainer.data.batch import RolloutBatch

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
    from rltrainer.lora import base_name  # a LoRA policy's base weights load from the plain names

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


def response_log_probs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
    padding_free: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of ``batch["responses"]`` under ``model``.

    Runs ``model`` on ``input_ids [n, P+T]`` and keeps only the ``T`` positions that predict the
    response (``logits_to_keep``), so the LM head never sees the prompt. Logits are divided by
    ``temperature`` to match the sampling distribution of the engine. Returns ``log_probs [n, T]``
    and ``entropy [n, T]`` (or ``None``), both float32. The entropy carries gradients only with
    ``entropy_grad``.

    The LM head runs in chunks of ``chunk_tokens`` tokens (default: 32 MiB of fp32 logits per
    chunk on CPU, see :mod:`rltrainer.lm_head`), so ``[n, T, V]`` logits are never held, and the
    backward recomputes each chunk. This needs a plain ``nn.Linear`` head without bias applied
    last (transformers causal LMs; a model may instead offer ``lm_head_log_probs``, as megatron's
    does); other models (a LoRA-wrapped head, logit soft-capping) take the full-logits path, as
    does ``chunk_tokens=0``.

    Columns that are padding in every row of ``batch`` (a micro-batch) are left out: the left
    padding up to its longest prompt and the right padding past its longest response, so a
    micro-batch of short rows does not pay for the longest rows of the step; the outputs there are
    0. With ``padding_free`` (default: ``batch.meta["padding_free"]``, which the Strategy sets on its
    micro-batches when built with ``padding_free=True``) the rows run as one packed sequence
    without their padding (:mod:`rltrainer.packing`); the LM head sees only the real response
    tokens, and response padding gets 0 in both outputs.
    """
    from rltrainer.lm_head import embedding_into_grad

    with embedding_into_grad(model):  # inside gradients_into_parameters only (the training step's)
        return _response_log_probs(model, batch, temperature, with_entropy, entropy_grad, chunk_tokens, padding_free)


def _response_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float, with_entropy: bool,
                        entropy_grad: bool, chunk_tokens: int | None, padding_free: bool | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    responses = batch["responses"]  # [n, T]
    T = responses.shape[1]
    if padding_free is None:
        from rltrainer.packing import marked_padding_free

        padding_free = marked_padding_free(batch)
    if padding_free:
        return _packed_log_probs(model, batch, temperature, with_entropy, entropy_grad, chunk_tokens)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"])
    if chunk_tokens != 0 and hasattr(model, "lm_head_log_probs"):  # megatron's model: its own shapes
        log_probs, entropy = model.lm_head_log_probs(**inputs, targets=responses, temperature=temperature,
                                                     chunk_tokens=chunk_tokens)
        return log_probs, _entropy(entropy, with_entropy, entropy_grad)
    inputs, kept = trim_padding_columns(inputs, T)
    responses = responses[:, :kept]
    head = chunkable_head(model) if chunk_tokens != 0 else None
    if head is not None:
        with _head_returns_log_probs(head, responses, temperature, chunk_tokens):
            out = model(**inputs, use_cache=False, logits_to_keep=kept + 1).logits  # [n, kept, 2]
        log_probs, entropy = out[..., 0], _entropy(out[..., 1], with_entropy, entropy_grad)
    else:
        logits = model(**inputs, use_cache=False, logits_to_keep=kept + 1).logits[:, :-1]  # P-1+t predicts t
        log_probs, entropy = _log_probs_from_logits(logits, responses, temperature, with_entropy, entropy_grad)
    return pad_columns(log_probs, T), None if entropy is None else pad_columns(entropy, T)


def trim_padding_columns(inputs: dict[str, torch.Tensor], T: int) -> tuple[dict[str, torch.Tensor], int]:
    """``inputs`` (``input_ids``, ``attention_mask``, ``position_ids``, each ``[n, P+T]``: left-padded
    prompts, then right-padded responses of ``T`` columns) without the columns that are padding in
    every row, and how many response columns remain (at least 1). The last prompt column (it
    predicts the first response token) always stays. Exact: a column every row masks out changes
    no other position's attention, and positions come from ``position_ids``."""
    mask = inputs["attention_mask"]
    P = mask.shape[1] - T
    real = mask.bool().any(0).nonzero()  # [k, 1] columns some row attends
    if len(real) == 0:
        return inputs, T
    first, last = int(real[0]), int(real[-1])
    start, kept = min(first, P - 1), min(T, max(1, last + 1 - P))
    if start == 0 and kept == T:
        return inputs, T
    return {k: v[:, start : P + kept] for k, v in inputs.items()}, kept


def pad_columns(x: torch.Tensor, T: int) -> torch.Tensor:
    """``x [n, kept]`` with zeros appended up to ``T`` columns."""
    return x if x.shape[1] == T else F.pad(x, (0, T - x.shape[1]))


def _packed_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float, with_entropy: bool,
                      entropy_grad: bool, chunk_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_log_probs` on the rows packed into one sequence (:mod:`rltrainer.packing`)."""
    from rltrainer.packing import packed_rows_for

    if hasattr(model, "lm_head_log_probs"):
        raise NotImplementedError(f"{type(model).__name__} computes its own log-probs (megatron's model) and takes "
                                  "padded rows only: turn padding_free off for it")
    packed = packed_rows_for(model, batch)
    targets = batch["responses"][packed.rows, packed.cols][None]  # [1, M]
    head = chunkable_head(model) if chunk_tokens != 0 else None
    if head is not None:
        with _head_returns_log_probs(head, targets, temperature, chunk_tokens):
            out = model(**packed.inputs, use_cache=False, logits_to_keep=packed.predictors).logits[0]  # [M, 2]
        log_probs, entropy = out[:, 0], _entropy(out[:, 1], with_entropy, entropy_grad)
    else:
        logits = model(**packed.inputs, use_cache=False, logits_to_keep=packed.predictors).logits  # [1, M, V]
        log_probs, entropy = _log_probs_from_logits(logits, targets, temperature, with_entropy, entropy_grad)
        log_probs, entropy = log_probs[0], None if entropy is None else entropy[0]
    return packed.unpack(log_probs), None if entropy is None else packed.unpack(entropy)


def _log_probs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                           entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets [n, T]`` and entropies from full ``logits [n, T, V]``, in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = logits.log_softmax(-1)  # one fused pass; faster than logsumexp on CPU
    log_probs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_log_softmax(log_softmax if entropy_grad else log_softmax.detach())
    return log_probs, entropy


def _entropy(entropy: torch.Tensor, with_entropy: bool, entropy_grad: bool) -> torch.Tensor | None:
    if not with_entropy:
        return None
    return entropy if entropy_grad else entropy.detach()


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """``model``'s LM head if :func:`response_log_probs` may replace it by the chunked one: a plain
    bias-free ``nn.Linear`` whose output the model returns as is (no soft-capping)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    if getattr(text_config, "final_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return None
    return head


@contextlib.contextmanager
def _head_returns_log_probs(head: torch.nn.Linear, responses: torch.Tensor, temperature: float,
                            chunk_tokens: int | None) -> Iterator[None]:
    """Inside it, ``head(hidden [n, T+1, H])`` returns ``[n, T, 2]``: the log-probs of
    ``responses [n, T]`` and the entropies, computed in chunks from ``head.weight``. The work runs
    inside the head's call, so a sharded model's gathered weight (FSDP2) is what it reads."""
    from rltrainer.lm_head import chunked_log_probs

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        n, T = responses.shape
        h = hidden[:, :T].reshape(n * T, hidden.shape[-1])  # position P-1+t predicts response t
        log_probs, entropy = chunked_log_probs(h, head.weight, responses.reshape(-1), temperature, chunk_tokens)
        return torch.stack([log_probs, entropy], -1).view(n, T, 2)

    with head_forward(head, forward):
        yield


@contextlib.contextmanager
def head_forward(head: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside it, ``head(x)`` is ``forward(x)`` (an instance attribute over the class's forward;
    the previous one is restored after)."""
    previous = head.__dict__.get("forward")
    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., tokens]``."""
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_log_softmax(log_softmax: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum(p * log p)`` over the last dimension, from ``log_softmax(logits)``."""
    return -(log_softmax.exp() * log_softmax).sum(-1)
