"""What the trainer needs of a causal LM, checked on the model itself rather than assumed from its
family's name.

A strategy accepts any model that transformers builds with ``AutoModelForCausalLM`` and refuses
one only for a reason it can name (:func:`check_causal_lm`, :func:`check_fast_paths`): the
feature it cannot handle, what it supports, and what to use instead. The fast paths are checked
by running the model on a few tokens once (the answers are kept on the model):

- the chunked LM head (:mod:`rltrainer.lm_head`) replaces the head's output with log-probs, so
  it needs to know what the model does to that output before returning its logits:
  :func:`head_output` replaces the head by a known ramp and reads the logits back. Nothing
  (llama, qwen, mistral...), a constant factor (Granite's ``1 / logits_scaling``, Cohere's
  ``logit_scale``) and a final soft-cap (Gemma 2's ``final_logit_softcapping``) are taken into the
  chunked head; anything else makes the trainer use the full logits, so the log-probs are always
  those of the model's own ``logits``;
- padding-free packing (:mod:`rltrainer.packing`) needs every layer to keep the packed rows
  apart: :func:`packing_problem` runs two packed rows and checks the model built its attention
  masks from the restarting ``position_ids`` (transformers' ``find_packed_sequence_indices``), and
  that it has only attention layers (a recurrent or convolutional layer carries state across the
  rows' boundary). gpt-oss, for one, builds its masks without the positions, so its packed rows
  would attend to each other: ``padding_free=True`` is refused for it at setup;
- activation checkpointing needs ``supports_gradient_checkpointing``; FSDP2's per-layer wrapping
  needs the blocks named in ``_no_split_modules`` (:func:`fsdp_blocks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from rltrainer.lm_head import head_forward
from rltrainer.models.moe import suspended
from rltrainer.packing import uses_flash_attention

#: Layer types (transformers' ``config.layer_types``) whose masks keep packed rows apart.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

_HEAD_OUTPUT = "_rltrainer_head_output"
_PACKING = "_rltrainer_packing_problem"


@dataclasses.dataclass(frozen=True)
class HeadOutput:
    """What a causal LM returns as ``logits`` for its LM head's output ``z``:
    ``softcap * tanh(z * scale / softcap)`` (``softcap=None``: ``z * scale``). ``neutral``: the
    config setting ``(attribute, value)`` under which the model returns ``z`` itself (Granite's
    ``logits_scaling=1.0``, Gemma 2's ``final_logit_softcapping=None``), found and checked by
    :func:`head_output`; code that replaces the head's output (the chunked head, the ``hf``
    engine's sampler) runs the model under it (:meth:`returned_as_is`) and applies the transform
    itself (:meth:`apply`)."""

    scale: float = 1.0
    softcap: float | None = None
    neutral: tuple[str, Any] | None = None

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """The logits for head outputs ``z`` (in place on a float tensor the caller owns)."""
        if self.scale != 1.0:
            z = z.mul_(self.scale)
        if self.softcap is not None:
            z = z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    @contextlib.contextmanager
    def returned_as_is(self, model: torch.nn.Module) -> Iterator[None]:
        """Inside it, ``model`` returns its head's output as its logits (nothing to do for most)."""
        if self.neutral is None:
            yield
            return
        with _config_set(model, *self.neutral):
            yield


def check_causal_lm(model: torch.nn.Module, strategy: str) -> None:
    """Raise, naming the reason, if ``model`` (a policy just built, possibly on the meta device) is
    not a causal LM the trainer and its engines can run: a transformers model whose config
    ``AutoModelForCausalLM`` builds (the engines build their own copy from it) and whose forward
    takes ``attention_mask``, ``position_ids`` and ``logits_to_keep``."""
    config = getattr(model, "config", None)
    where = f"strategy={strategy!r} trains transformers causal LMs"
    if config is None or not hasattr(config, "model_type"):
        raise ValueError(f"{where}; the policy is a {type(model).__name__} with no transformers config. Build it with "
                         "rltrainer.models.build_causal_lm (a hub id, a path or a PretrainedConfig), or "
                         "AutoModelForCausalLM, so that the rollout engines can build it from its config.")
    problem = config_problem(config)
    if problem is not None:
        raise ValueError(f"{where}; the policy's {problem}")
    forward = inspect.signature(_inner_forward(model)).parameters
    missing = [a for a in ("attention_mask", "position_ids", "logits_to_keep") if a not in forward
               and not any(p.kind is p.VAR_KEYWORD for p in forward.values())]
    if missing:
        raise ValueError(f"{where}; {type(model).__name__}.forward takes no {', '.join(missing)}, which the trainer passes "
                         "(the response's log-probs are computed from the last positions only, with the rows' own "
                         "positions). Use a transformers version whose model of this family takes them.")


def config_problem(config: Any) -> str | None:
    """Why no rollout engine can build a model from ``config`` (``AutoModelForCausalLM.from_config``,
    as the engines do), or ``None``. The config itself must be one AutoModelForCausalLM builds: a
    vision-language config whose text config is (Llava's, Qwen2-VL's) builds no engine."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    return (f"config is a {type(config).__name__} (model_type={config.model_type!r}), which AutoModelForCausalLM "
            "does not build, so no rollout engine can build it. Use the causal LM of that family (for a "
            "vision-language model, its language model with its text config, e.g. Gemma3ForCausalLM with "
            "Gemma3TextConfig) or register the config with AutoModelForCausalLM.register.")


def base_config(model: torch.nn.Module) -> Any:
    """The config of ``model``'s text decoder (``get_text_config``)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def class_name(model: torch.nn.Module) -> str:
    """The name of ``model``'s class; FSDP2's ``fully_shard`` swaps it for a subclass named
    ``FSDP<name>``, which is not the name a user knows."""
    cls = type(model)
    wrapped = cls.__bases__[-1]
    return wrapped.__name__ if cls.__name__ == f"FSDP{wrapped.__name__}" else cls.__name__


def check_activation_checkpointing(model: torch.nn.Module, name: str) -> None:
    """Raise if ``model`` (the module's ``name``) cannot checkpoint its layers' activations."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation_checkpointing=True: {name} is a {class_name(model)}, which transformers marks "
                         "supports_gradient_checkpointing=False. Turn activation_checkpointing off for it.")


def fsdp_blocks(model: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 wraps one by one: the modules of the classes ``model`` names in
    ``_no_split_modules``; raises if it names none that it holds (its layers would then be one
    unit, gathered whole at every forward)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"strategy='fsdp2' shards each transformer block of a model on its own, found by the classes "
                         f"the model names in _no_split_modules; {name} ({type(model).__name__}) names "
                         f"{sorted(names) or 'none'} and holds none of them. Use strategy='single', or set the "
                         "model's _no_split_modules to its decoder layer's class name.")
    return blocks


# -- the LM head's output ------------------------------------------------------------------------
def chunkable_head(model: torch.nn.Module) -> tuple[torch.nn.Linear, HeadOutput] | None:
    """``model``'s LM head, if :func:`~rltrainer.models.response_log_probs` may replace it by the chunked one (a
    plain bias-free ``nn.Linear``), and what the model does to its output before returning it as
    logits (:func:`head_output`: nothing, a factor, a soft-cap; found by
    running the model once). ``None``: the full logits are used."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    output = head_output(model, head)
    return None if output is None else (head, output)


def head_output(model: torch.nn.Module, head: torch.nn.Module) -> HeadOutput | None:
    """What ``model`` does to ``head``'s output before returning it as ``logits`` (:class:`HeadOutput`),
    found by running the model once on two tokens with the head replaced by a known ramp (kept on
    the model). ``None``: something the chunked head cannot take (the caller uses the full logits)."""
    if _HEAD_OUTPUT not in model.__dict__:
        model.__dict__[_HEAD_OUTPUT] = _probe_head(model, head)
    return model.__dict__[_HEAD_OUTPUT]


def _probe_head(model: torch.nn.Module, head: torch.nn.Module) -> HeadOutput | None:
    vocab = head.weight.shape[0]
    made: list[torch.Tensor] = []

    def ramp(hidden: torch.Tensor) -> torch.Tensor:
        z = torch.linspace(-60.0, 60.0, vocab, device=hidden.device).to(hidden.dtype)
        made.append(z.expand(*hidden.shape[:-1], vocab).clone())
        return made[-1]

    with head_forward(head, ramp), _evaluating(model):
        logits = model(input_ids=_probe_ids(model, 2), use_cache=False, logits_to_keep=1).logits
    if len(made) != 1 or logits.shape[-1] != vocab:
        return None
    z, out = made[0].double(), logits.double()
    rtol = 4 * torch.finfo(logits.dtype).eps if logits.dtype.is_floating_point else 1e-6
    if out is made[0] or torch.allclose(out, z, rtol=rtol, atol=0):
        return HeadOutput()
    found = None
    scale = float(out[..., -1].flatten()[0] / z[..., -1].flatten()[0])
    if scale > 0 and torch.allclose(out, z * scale, rtol=rtol, atol=0):
        found = HeadOutput(scale=scale)
    else:
        cap = float(out.abs().max())  # a soft-cap of c maps +-60 to about +-c if c is much smaller than 60
        for softcap in (_config_softcap(model), cap):
            if softcap and torch.allclose(out, softcap * torch.tanh(z / softcap), rtol=max(rtol, 1e-6),
                                          atol=rtol * softcap):
                found = HeadOutput(softcap=softcap)
                break
    if found is None:
        return None
    for setting in _neutral_candidates(model, found):  # the config value that switches the transform off
        with _config_set(model, *setting):
            if _probe_head(model, head) == HeadOutput():
                return dataclasses.replace(found, neutral=setting)
    return None


def _neutral_candidates(model: torch.nn.Module, found: HeadOutput) -> Iterator[tuple[str, Any]]:
    """``(attribute, value)`` settings of the config that may switch ``found``'s transform off: a
    number equal to the soft-cap (set to ``None``), or to the factor or its inverse (set to 1)."""
    config = base_config(model)
    for name, value in sorted(vars(config).items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value:
            continue
        if found.softcap is not None and abs(value - found.softcap) <= 1e-6 * found.softcap:
            yield name, None
        elif found.softcap is None and (abs(value - found.scale) <= 1e-6 * found.scale
                                        or abs(value * found.scale - 1) <= 1e-6):
            yield name, 1.0


@contextlib.contextmanager
def _config_set(model: torch.nn.Module, name: str, value: Any) -> Iterator[None]:
    config = base_config(model)
    before = getattr(config, name)
    setattr(config, name, value)
    try:
        yield
    finally:
        setattr(config, name, before)


def _config_softcap(model: torch.nn.Module) -> float | None:
    value = getattr(base_config(model), "final_logit_softcapping", None) or getattr(model.config,
                                                                                  "final_logit_softcapping", None)
    return float(value) if value else None


# -- packed rows ---------------------------------------------------------------------------------
def packing_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s packed rows (:mod:`rltrainer.packing`) would not stay apart, or ``None`` if
    they do (checked once, kept on the model)."""
    if _PACKING not in model.__dict__:
        model.__dict__[_PACKING] = _probe_packing(model)
    return model.__dict__[_PACKING]


def _probe_packing(model: torch.nn.Module) -> str | None:
    types = set(getattr(base_config(model), "layer_types", None) or [])
    other = sorted(t for t in types - ATTENTION_LAYER_TYPES if isinstance(t, str))
    if other:
        return (f"it has layers of type {', '.join(other)} (config.layer_types), which carry state from one position to "
                "the next, across the boundary of packed rows")
    if uses_flash_attention(model):
        return None  # flash-attention's varlen kernels take the rows' boundaries (cu_seq_lens)
    import transformers.masking_utils as masking

    found: list[bool] = []
    original = masking.find_packed_sequence_indices

    def spy(position_ids: torch.Tensor) -> torch.Tensor | None:
        out = original(position_ids)
        found.append(out is not None)
        return out

    ids = _probe_ids(model, 4)
    masking.find_packed_sequence_indices = spy
    try:
        with _evaluating(model):
            model(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1]], device=ids.device), attention_mask=None,
                  use_cache=False, logits_to_keep=1)
    finally:
        masking.find_packed_sequence_indices = original
    if not any(found):
        return ("its forward does not build its attention masks from the packed rows' restarting position_ids "
                "(transformers' masking_utils.find_packed_sequence_indices is never reached), so each row would "
                "attend to the rows packed before it")
    return None


def check_fast_paths(model: torch.nn.Module, strategy: str, padding_free: bool) -> None:
    """Run the probes on ``model`` (a policy with its weights, on its device; every rank of a
    sharded one calls it at the same point, since it runs forward passes) and raise if
    ``padding_free`` is asked of a model whose packed rows would mix. The LM head's answer only
    picks the path (:func:`head_output`)."""
    chunkable_head(model)  # probed now, so no forward pass is added to the first step
    if padding_free:
        problem = packing_problem(model)
        if problem is not None:
            raise ValueError(f"strategy={strategy!r} with padding_free=True packs each micro-batch's rows into one "
                             f"sequence, but {class_name(model)} cannot keep packed rows apart: {problem}. Use "
                             "padding_free=False for this model (its rows then run padded).")


def _probe_ids(model: torch.nn.Module, length: int) -> torch.Tensor:
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    vocab = base_config(model).vocab_size
    return torch.tensor([[(1 + i) % vocab for i in range(length)]], device=device)


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """No gradients, eval mode (then the previous mode again), the RNG untouched, no routing replay
    or record (:func:`rltrainer.models.moe.suspended`)."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), suspended(model):
            yield
    finally:
        model.train(training)


def _inner_forward(model: torch.nn.Module) -> Any:
    """The forward of the transformers model inside a wrapper (peft's ``PeftModel``)."""
    base = getattr(model, "get_base_model", None)
    return (base() if callable(base) else model).forward
