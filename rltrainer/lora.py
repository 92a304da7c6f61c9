"""LoRA with ``peft``: the policy wrapped in a ``PeftModel`` (only the adapter trains), the reference
model as the same policy with its adapter disabled, and the names weights travel under.

A LoRA policy's parameters have peft's names (``base_model.model.<hf module>.base_layer.weight``,
``....lora_A.default.weight``). What leaves the strategy is a :class:`LoraView` of them, one of:

- ``"merged"``: plain HF names; each adapted linear's ``weight`` is ``W + scaling * B @ A``. Any
  engine loads it; every adapted weight changes at every step, so a sync sends those (the frozen
  rest is sent once).
- ``"adapter"``: the base weights in plain HF names (unmerged) and the adapter as peft saves it
  (``base_model.model.<hf module>.lora_A.weight``): for an engine that loads adapters
  (``RolloutEngine.loads_adapters``). After the first sync only the adapter moves.
- ``"adapter_only"``: the adapter alone (an export).

``peft`` is an optional dependency (``pip install -e ".[lora]"``), imported only here, when used.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch

LORA_VIEWS = ("merged", "adapter", "adapter_only")
_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"
_SOURCE_ATTR = "_rltrainer_weight_source"  # rltrainer.models' weight source, moved onto the wrapper


def require_peft() -> Any:
    try:
        import peft
    except ImportError as e:  # pragma: no cover - peft is in the dev extra
        raise ImportError("lora=... needs peft: pip install -e '.[lora]' (peft==0.21.2)") from e
    return peft


def check_lora_config(config: Any) -> Any:
    """Refuse, before any model is built, a LoRA config this integration does not support."""
    peft = require_peft()
    if not isinstance(config, peft.LoraConfig):
        raise TypeError(f"lora must be a peft.LoraConfig, got {type(config).__name__}; e.g. "
                        "lora=peft.LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')")
    unsupported = {"use_dora": config.use_dora, "fan_in_fan_out": config.fan_in_fan_out,
                   "lora_bias": getattr(config, "lora_bias", False), "modules_to_save": config.modules_to_save,
                   "init_lora_weights": config.init_lora_weights if config.init_lora_weights is not True else None}
    bad = {k: v for k, v in unsupported.items() if v}
    if bad:
        raise ValueError(f"LoraConfig with {bad} is not supported: rltrainer merges and syncs plain LoRA on linear "
                         "layers (B @ A, default init). Leave these at their defaults.")
    return config


def base_name(peft_name: str) -> str:
    """A peft parameter name -> the transformers name of the base weight it is or adapts
    (``base_model.model.X.base_layer.weight`` -> ``X.weight``); other names unchanged."""
    return peft_name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_name(peft_name: str) -> str:
    """``...X.lora_A.default.weight`` -> peft's saved key ``base_model.model.X.lora_A.weight``."""
    return peft_name.replace(f".{_ADAPTER}.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def apply_lora(model: torch.nn.Module, config: Any, seed: int = 0) -> torch.nn.Module:
    """``peft.get_peft_model(model, config)`` with the adapter on CPU even when ``model`` is on the
    meta device (a sharding strategy's deferred build), its ``A`` drawn from a generator of its own
    seeded with ``seed`` (``B`` is zero): every rank and strategy gets the same adapter, and the
    global RNG is left as the model's build left it. ``model``'s weight source moves onto the wrapper."""
    peft = require_peft()
    from peft.tuners.lora import LoraLayer, Linear

    source = model.__dict__.pop(_SOURCE_ATTR, None)
    with torch.random.fork_rng(devices=[]):
        wrapped = peft.get_peft_model(model, copy.deepcopy(config))
    generator = torch.Generator().manual_seed(seed)
    for name, layer in wrapped.named_modules():
        if isinstance(layer, LoraLayer) and not isinstance(layer, Linear):
            raise ValueError(f"LoRA on {name} ({type(layer).__name__}): only linear layers are supported; "
                             "choose target_modules among the attention and MLP projections.")
        base = getattr(layer, "base_layer", None)
        if isinstance(layer, Linear) and type(base).forward is not torch.nn.Linear.forward:
            # peft adds the adapter's product to whatever the layer returns (Llama 4's router: a tuple)
            raise ValueError(f"LoRA on {name}: its layer is a {type(base).__name__}, an nn.Linear with a forward of "
                             "its own (a mixture of experts' router), which an adapter cannot wrap as a linear map. "
                             "Leave it out of target_modules: name the attention and MLP projections.")
        if isinstance(layer, Linear):
            a, b = layer.lora_A[_ADAPTER], layer.lora_B[_ADAPTER]
            dtype = a.weight.dtype
            a.to_empty(device="cpu"), b.to_empty(device="cpu")
            with torch.no_grad():
                a.weight.copy_(torch.nn.init.kaiming_uniform_(torch.empty(a.weight.shape), a=math.sqrt(5),
                                                              generator=generator).to(dtype))
                b.weight.zero_()
    if source is not None:
        wrapped.__dict__[_SOURCE_ATTR] = source
    return wrapped


@contextlib.contextmanager
def adapter_disabled(policy: torch.nn.Module) -> Iterator[None]:
    """The base model: the reference policy of a LoRA run (no second copy)."""
    with policy.disable_adapter():
        yield


# -- what leaves the strategy --------------------------------------------------------------------------
class LoraView:
    """The names and tensors a LoRA policy exports as (``mode``, one of :data:`LORA_VIEWS`).

    Built from the policy (a ``PeftModel``; its parameters may be sharded DTensors: only names,
    global shapes and dtypes are read). :meth:`tensor` computes an output from the full tensors of
    its :meth:`sources`."""

    def __init__(self, policy: torch.nn.Module, mode: str) -> None:
        from peft.tuners.lora import Linear

        if mode not in LORA_VIEWS:
            raise ValueError(f"LoRA view {mode!r}; choose from {', '.join(LORA_VIEWS)}")
        self.mode = mode
        params = dict(policy.named_parameters())
        scaling = {f"{name}.": layer.scaling[_ADAPTER] for name, layer in policy.named_modules()
                   if isinstance(layer, Linear)}
        self._sources: dict[str, list[str]] = {}
        self._scaling: dict[str, float] = {}
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, param in params.items():
            out, sources = self._output(name, scaling)
            if out is None:
                continue
            self._sources[out] = sources
            self.specs[out] = (tuple(param.shape), param.dtype)
            if len(sources) == 3:
                self._scaling[out] = scaling[name[: -len("base_layer.weight")]]
        self._outputs_of: dict[str, list[str]] = {}
        for out, sources in self._sources.items():
            for source in sources:
                self._outputs_of.setdefault(source, []).append(out)

    def _output(self, name: str, scaling: dict[str, float]) -> tuple[str | None, list[str]]:
        if is_adapter(name):
            return (None, []) if self.mode == "merged" else (adapter_name(name), [name])
        if self.mode == "adapter_only":
            return None, []
        prefix = name[: -len("base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if self.mode == "merged" and prefix in scaling:
            lora = f"{prefix}lora_%s.{_ADAPTER}.weight"
            return base_name(name), [name, lora % "A", lora % "B"]
        return base_name(name), [name]

    def sources(self, names: list[str]) -> list[str]:
        """The policy parameters the outputs ``names`` are made of, each once, in order."""
        return list(dict.fromkeys(s for n in names for s in self._sources[n]))

    def outputs_of(self, params: list[str]) -> list[str]:
        """The outputs a change of the policy parameters ``params`` changes (for the sync versions)."""
        return list(dict.fromkeys(o for p in params for o in self._outputs_of.get(p, [])))

    def tensor(self, name: str, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """Output ``name`` from the full tensors of its sources: a merged weight is
        ``W + scaling * B @ A`` (computed in float32, returned in ``W``'s dtype)."""
        sources = self._sources[name]
        if len(sources) == 1:
            return full[sources[0]]
        w, a, b = (full[s] for s in sources)
        return (w.float() + self._scaling[name] * (b.float() @ a.float())).to(w.dtype)


@contextlib.contextmanager
def lora_view(strategy: Any, mode: str) -> Iterator[None]:
    """``strategy`` exports its LoRA policy as ``mode`` inside (an export; a sync is not in flight)."""
    before = strategy.weight_view
    strategy.set_weight_view(mode)
    try:
        yield
    finally:
        strategy.set_weight_view(before)


def adapter_weights(strategy: Any, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter alone, in peft's saved names, gathered from ``strategy`` bucket by bucket."""
    with lora_view(strategy, "adapter_only"):
        yield from strategy.export_weights(dtype)


def engine_view(lora: Any, engine: Any) -> str | None:
    """The view a sync to ``engine`` uses: ``"adapter"`` if it loads adapters, else ``"merged"``
    (``None`` without LoRA)."""
    if lora is None:
        return None
    return "adapter" if getattr(engine, "loads_adapters", False) else "merged"
