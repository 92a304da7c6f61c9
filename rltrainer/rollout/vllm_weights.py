"""The policy's weights in the form vLLM's loaders take, and the names vLLM must receive together.

Transformers 5 keeps a mixture-of-experts layer's experts fused in the model
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), while hub
checkpoints, which vLLM's ``load_weights`` is written against, keep them per expert
(``mlp.experts.{e}.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``).
vLLM 0.32 / 0.33 take the fused tensors only in the models whose loader reaches
``MoERunner.load_weights`` (its ``include_fused`` mapping: Qwen3-MoE, Qwen2-MoE, OLMoE); DeepSeek's
and GPT-OSS's loaders read checkpoint names only. Transformers declares, per architecture, how
checkpoint names become the model's (``conversion_mapping.py``) and reverses it for
``save_pretrained`` (``core_model_loading.revert_weight_conversion``): :class:`CheckpointForm`
applies that reversal to each bucket, here, in the engine's process, with the engine's transformers.

Why here and not on the trainer's side: the sync (the buckets, the per-parameter versions that
pick what changed, delta sync's mirror and checksums) stays keyed by the policy's own parameter
names, one tensor each, whatever the engine (two wire entries per MoE layer, not ``3 E``); each
engine takes the form its loader needs (``hf`` loads the policy's names as they are); and the
engine's transformers reverses what the engine's vLLM loads. The cost: the reversal splits
``gate_up_proj`` into contiguous halves, one transient copy of a bucket's fused tensors in the
engine's process (a layer's experts travel together in one bucket, so at most that layer's).

Which names travel together is vLLM's business too: vLLM rebuilds each of its layers once all of
its tensors arrived in a session (layerwise reload), so every name that feeds a layer must be in the
same sync and the same bucket. :func:`loading_layers` finds out by running the model's own
``load_weights`` on meta tensors with every parameter's ``weight_loader`` replaced by a recorder (no
value is read or written), and :func:`groups_by_layer` joins the names that reach one layer:
``q/k/v`` into ``qkv_proj``, DeepSeek's ``q_a_proj`` and ``kv_a_proj_with_mqa`` into
``fused_qkv_a_proj``, and a MoE layer's ``gate_up_proj`` and ``down_proj`` into its ``FusedMoE``
(``w13_weight`` and ``w2_weight`` live in one module). A name vLLM's loader writes around its
``weight_loader`` would never reach vLLM through a weight update (:func:`written_directly`): the
engine refuses the policy.

This module imports transformers when a :class:`CheckpointForm` is built; the recorder runs in
vLLM's worker (``LLM.apply_model``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

Named = list[tuple[str, torch.Tensor]]


class CheckpointForm:
    """Turns ``(name, tensor)`` of the policy (transformers' model names) into checkpoint names and
    tensors, by transformers' own reversal for the config's architecture; no reversal (dense
    families) passes them through.

    Args:
        model_config: the policy's transformers config (the engine's copy).
    """

    def __init__(self, model_config: Any) -> None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # no memory: only the module tree and shapes
            self.meta = AutoModelForCausalLM.from_config(model_config)
        self.architecture = type(self.meta).__name__
        self.shapes = {name: tuple(p.shape) for name, p in self.meta.named_parameters()}
        self.identity = not self._reversal()

    def _reversal(self) -> list[Any]:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        conversions = getattr(self.meta, "_weight_conversions", None)
        if conversions is None:
            conversions = get_model_conversion_mapping(self.meta, add_legacy=False)
        return [c for c in conversions if not isinstance(c, PrefixChange)]  # as revert_weight_conversion does

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Named:
        """Checkpoint-named tensors (the tensors themselves where nothing is reversed)."""
        weights = list(weights)
        if self.identity or not weights:
            return weights
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self.meta, dict(weights)).items())

    def check_names(self, names: Sequence[str], transformers_version: str) -> None:
        """Every policy name is one this transformers builds (else its reversal would not know it)."""
        unknown = [n for n in names if n not in self.shapes]
        if unknown:
            raise ValueError(
                f"The vLLM engine's transformers {transformers_version} builds {self.architecture} without "
                f"{len(unknown)} of the policy's parameters (first: {unknown[:3]}), so it cannot put them in the form "
                "vLLM loads. The trainer's and the engine's transformers name this architecture's weights "
                "differently: install the trainer's transformers version in the engine's environment.")

    def meta_feeds(self, names: Sequence[str]) -> list[Named]:
        """For each name, its checkpoint form as meta tensors (what :func:`loading_layers` feeds)."""
        return [self.convert([(n, torch.empty(self.shapes[n], device="meta"))]) for n in names]


Reached = dict[str, list[str]] | str  # {"loader": modules, "direct": modules}, or the error raised


def loading_layers(model: torch.nn.Module, feeds: Sequence[Named]) -> list[Reached]:
    """For each feed (one policy name's checkpoint tensors), the vLLM modules whose parameters its
    ``load_weights`` reaches through their ``weight_loader`` (``"loader"``) or by writing into
    them itself (``"direct"``), or the error it raised (run in vLLM's worker, by ``LLM.apply_model``).

    Feeds are meta tensors. Every parameter's ``weight_loader`` (the hook vLLM's loaders call,
    through ``getattr(param, "weight_loader", default_weight_loader)``) is replaced by a recorder
    for the duration, and a loader that writes into a parameter itself (GPT-OSS's experts and
    sinks: ``param.copy_(...)``) is caught writing a meta tensor into it and skipped; a loader
    that reads a value (``.item()``) raises, and its error is reported."""
    from torch.overrides import TorchFunctionMode

    owners: dict[int, set[str]] = {}  # a parameter's id, and its storage's address -> its modules
    for module_name, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(module_name)
                if param.untyped_storage().nbytes():
                    owners.setdefault(param.untyped_storage().data_ptr(), set()).add(module_name)
    reached: list[int] = []
    direct: list[int] = []
    writes = {torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.fill_, torch.Tensor.zero_}

    class DirectWrites(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            target = args[0] if args else None
            if func in writes and isinstance(target, torch.Tensor) and not target.is_meta:
                if any(isinstance(a, torch.Tensor) and a.is_meta for a in args[1:]):
                    direct.append(target.untyped_storage().data_ptr())
                    return target  # a meta value into real memory: recorded, not written
            return func(*args, **(kwargs or {}))

    def recorder(param: torch.nn.Parameter) -> Any:
        def weight_loader(*args: Any, **kwargs: Any) -> bool:
            reached.append(id(param))
            return True  # loaders that ask (return_success=True) go on to the next shard

        return weight_loader

    saved: dict[int, tuple[torch.nn.Parameter, Any, bool]] = {}
    for param in model.parameters():
        if id(param) not in saved:
            saved[id(param)] = (param, param.__dict__.get("weight_loader"), "weight_loader" in param.__dict__)
            param.weight_loader = recorder(param)
    out: list[Reached] = []
    try:
        for feed in feeds:
            reached.clear()
            direct.clear()
            try:
                with DirectWrites():
                    model.load_weights(feed)
            except Exception as exc:  # noqa: BLE001 - reported with the name, decided by the caller
                out.append(f"{type(exc).__name__}: {exc}")
                continue
            out.append({kind: sorted({m for key in keys for m in owners.get(key, ())})
                        for kind, keys in (("loader", reached), ("direct", direct))})
    finally:
        for param, loader, had in saved.values():
            if had:
                param.weight_loader = loader
            else:
                del param.weight_loader
    return out


def groups_by_layer(names: Sequence[str], layers: Sequence[Reached]) -> list[list[str]]:
    """The names (in order) that reach a common vLLM layer, joined transitively; groups of one are
    left out. ``layers[i]``: what :func:`loading_layers` found for ``names[i]`` (a name whose dry
    run raised stays alone: :func:`unplaced` names it)."""
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, reached in enumerate(layers):
        for layer in () if isinstance(reached, str) else reached["loader"] + reached["direct"]:
            j = first.setdefault(layer, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(names):
        groups.setdefault(root(i), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def unplaced(names: Sequence[str], layers: Sequence[Reached]) -> list[str]:
    """``name: reason`` for the names whose dry run raised or reached no vLLM parameter (vLLM skips
    them, or its loader reads values, which a dry run cannot give)."""
    return [f"{n}: {r if isinstance(r, str) else 'reached no vLLM parameter'}" for n, r in zip(names, layers)
            if isinstance(r, str) or not (r["loader"] or r["direct"])]


def written_directly(names: Sequence[str], layers: Sequence[Reached]) -> list[str]:
    """The names vLLM's loader writes into its parameters itself (``param.copy_``) instead of through
    their ``weight_loader``. vLLM's weight-update session (layerwise reload) restores each layer's
    parameters on the meta device and counts what its wrapped loaders take; a direct write goes to
    the meta tensor and is lost, and the layer keeps its old values (GPT-OSS's experts and sinks
    in vLLM 0.32: ``_load_weights_other``)."""
    return [n for n, r in zip(names, layers) if not isinstance(r, str) and r["direct"] and not r["loader"]]
