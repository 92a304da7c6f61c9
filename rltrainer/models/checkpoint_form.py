"""A model's weights in memory and in its hub checkpoint, which for some families differ.

transformers 5 holds a mixture of experts' weights fused (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``), while the hub's checkpoints, and the engines that load them
(vLLM, SGLang), store each expert on its own (``mlp.experts.{e}.gate_proj.weight``...; Mixtral:
``block_sparse_moe.experts.{e}.w1.weight``). ``from_pretrained`` converts one into the other with
the family's conversion mapping (``transformers.conversion_mapping``), ``save_pretrained``
reverts it (``transformers.core_model_loading.revert_weight_conversion``). Both directions use those
same mappings:

- :class:`ConvertedWeights` (here) shows a checkpoint's safetensors files under the model's own
  parameter names and shapes, so a sharded strategy (FSDP2, Megatron) reads each parameter's rows
  by name: a rank whose rows of ``gate_up_proj`` are experts 4-7 reads the files of those experts
  only;
- :func:`rltrainer.hf_export.to_checkpoint_form` turns a stream of in-memory ``(name, tensor)`` (a
  strategy's ``export_weights``) into the tensors ``save_pretrained`` writes, for the HF export.

Families whose two forms are the same (dense models, gpt-oss, Llama 4) pass through unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from rltrainer.models.safetensors_io import SafetensorsWeights, find_tensor


@dataclasses.dataclass
class _Fused:
    """One conversion of checkpoint tensors into in-memory ones: ``sources`` (per source pattern,
    the checkpoint's tensors in expert order) into ``outputs`` (in-memory name -> shape)."""

    converter: Any
    layer: str  # the in-memory name transformers converts under (its first output's)
    sources: dict[str, list[str]]
    outputs: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    by_rows: bool = False  # rows start:stop of the output are made from experts start:stop alone


class ConvertedWeights:
    """A checkpoint's safetensors files (:class:`SafetensorsWeights`) under the parameter names and
    shapes of ``model`` (built from the checkpoint's config, on the meta device): what
    ``from_pretrained`` would load into each parameter, read by name, rows ``start:stop`` at a
    time, as :class:`SafetensorsWeights` reads (:meth:`find`, :meth:`shape`, :meth:`read`).

    A fused parameter's rows (the experts of an ``[E, ...]`` tensor) are read from those experts'
    tensors only where the conversion stacks experts along the rows and joins them along another
    dimension (``MergeModulelist(dim=0)`` then ``Concatenate(dim>=1)``, every MoE family's); any
    other conversion reads its tensors whole and keeps the rows asked."""

    def __init__(self, files: SafetensorsWeights, config: Any, plans: dict[str, _Fused],
                 renamed: dict[str, str]) -> None:
        self.files, self.path = files, files.path
        self.config = config
        self.plans = plans  # in-memory name -> its conversion
        self.renamed = renamed  # in-memory name -> checkpoint tensor (renamed only, or as it is)
        self._last: tuple[int, int, int | None, dict[str, torch.Tensor]] | None = None  # one conversion's outputs

    def __deepcopy__(self, memo: dict[int, Any]) -> ConvertedWeights:
        return self  # a frozen copy reads the same files

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    def names(self) -> dict[str, tuple[int, ...]]:
        """In-memory name -> shape, of every tensor the checkpoint gives."""
        shapes = {name: self.files.shape(key) for name, key in self.renamed.items()}
        for plan in self.plans.values():
            shapes.update(plan.outputs)
        return shapes

    def find(self, aliases: list[str]) -> str:
        return find_tensor(aliases, self.names(), self.path)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.names()[name]

    def dtype(self) -> torch.dtype | None:
        return self.files.dtype()

    def read(self, name: str, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of the in-memory tensor ``name`` (into ``out``, cast as needed)."""
        if name not in self.plans:
            return self.files.read(self.renamed[name], start, stop, out)
        plan = self.plans[name]
        stop = plan.outputs[name][0] if stop is None else stop
        if plan.by_rows and stop <= start:  # an empty last shard
            first = next(iter(plan.sources.values()))[0]
            tensor = torch.empty((0, *plan.outputs[name][1:]), dtype=self.files.names()[first][2])
        elif plan.by_rows:
            tensor = self._convert(plan, start, stop)[name]
        else:
            tensor = self._convert(plan, 0, None)[name][start:stop]
        return tensor if out is None else out.copy_(tensor)

    def _convert(self, plan: _Fused, start: int, stop: int | None) -> dict[str, torch.Tensor]:
        """The outputs of ``plan`` from the experts ``start:stop`` of its sources (kept for the
        next read: a conversion with several outputs is read once for all of them)."""
        key = (id(plan), start, stop)
        if self._last is None or self._last[:3] != key:
            tensors = {pattern: [self.files.read(k) for k in keys[start:stop]]
                       for pattern, keys in plan.sources.items()}
            self._last = (*key, _run(plan, tensors, self.config))
        return self._last[3]


def converted_weights(files: SafetensorsWeights, model: torch.nn.Module) -> SafetensorsWeights | ConvertedWeights:
    """``files`` as ``model``'s parameters: themselves when the checkpoint holds every parameter
    under its own name, else a :class:`ConvertedWeights` applying the family's conversion mapping
    (as ``from_pretrained`` does: renamings, then at most one converter per tensor)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                 rename_source_key)

    stored = files.names()
    if all(name in stored for name, _ in model.named_parameters()):  # tied weights: named once
        return files
    params = dict(model.state_dict(keep_vars=True))  # what from_pretrained matches names against
    conversions = get_model_conversion_mapping(model)  # from_pretrained's, legacy renamings included
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    plans: dict[str, _Fused] = {}
    renamed: dict[str, str] = {}
    for key in sorted(stored, key=dot_natural_key):  # experts in numeric order (2 before 10), as from_pretrained
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, params)
        if target not in params and key in params:
            target, pattern = key, None
        if pattern is None:
            renamed[target] = key
            continue
        converter = by_pattern[pattern]
        plan = plans.setdefault(target, _Fused(converter, target, {p: [] for p in converter.source_patterns}))
        plan.sources[pattern].append(key)
    for plan in list(plans.values()):
        meta = {p: [torch.empty(files.shape(k), dtype=files.names()[k][2], device="meta") for k in keys]
                for p, keys in plan.sources.items()}
        plan.outputs = {n: tuple(t.shape) for n, t in _run(plan, meta, model.config).items()}
        plan.by_rows = len(plan.outputs) == 1 and _stacks_rows(plan.converter)
        for name in plan.outputs:
            plans[name] = plan
    return ConvertedWeights(files, model.config, plans, renamed)


def _run(plan: _Fused, tensors: dict[str, list[torch.Tensor]], config: Any) -> dict[str, torch.Tensor]:
    """``plan``'s conversion of ``tensors`` (source pattern -> its tensors, in expert order): the
    in-memory tensors under their full names, as ``from_pretrained`` makes them
    (``WeightConverter.convert``)."""
    converter = copy.deepcopy(plan.converter)  # collects the tensors: one instance per conversion
    for pattern, group in tensors.items():
        for tensor in group:
            converter.add_tensor(plan.layer, "", pattern, tensor)
    return converter.convert(plan.layer, config=config)


def _stacks_rows(converter: Any) -> bool:
    """Whether ``converter`` stacks its sources' tensors along dim 0 and touches no other row
    (``MergeModulelist(dim=0)``, then only ``Concatenate`` along another dimension)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    return (bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
            and all(type(op) is Concatenate and op.dim >= 1 for op in ops[1:]))
