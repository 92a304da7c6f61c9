"""A vLLM engine whose weights a test can read: ``Worker.engine_weights`` reads an engine's ``.model``,
which vLLM does not have; :class:`InspectableVLLMEngine` lends one that copies vLLM's own parameters
(vLLM's names and fused layout: ``qkv_proj``, ``gate_up_proj``, a padded vocabulary, a MoE layer's
experts as its ``FusedMoE`` holds them, ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]``)
through ``LLM.apply_model``. The CPU build packs a linear layer's weight for oneDNN (a MoE router's
``GateLinear`` too) and leaves the parameter empty; its weight is then read back as the layer
computes with it, from the product with an identity matrix (exact: one non-zero product per
output). The CPU build's fused-MoE layers keep ``w13_weight`` / ``w2_weight`` in the blocked layout
of ``cpu_prepack_moe_weight`` (a permutation of each expert's elements); they are read back in
vLLM's unpacked layout (:func:`unpacked_experts`), the intermediate size's zero padding dropped. For
tests: a copy of the whole model per call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rltrainer.rollout.vllm import VLLMEngine


def holds_exactly(held: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether a vLLM parameter ``held`` carries ``expected`` (what a full sync loads: the policy
    cast to the engine's dtype, in vLLM's layout) bit for bit, in its first rows (vLLM pads the
    vocabulary). The values are compared, in ``held``'s dtype: the CPU build keeps some tensors in
    a wider float than the engine's dtype, by CPU (a fused QKV bias in fp32 in a bf16 engine on
    Intel Xeons with AVX-512 and AMX, and on AMD EPYC), and a wider float holds each value of the
    narrower exactly; a narrower or integer dtype, or another shape, does not hold it."""
    rows = held[:expected.shape[0]]
    if rows.shape != expected.shape:
        return False
    if rows.dtype != expected.dtype:
        if not (rows.is_floating_point() and expected.is_floating_point()):
            return False
        wide, narrow = torch.finfo(rows.dtype), torch.finfo(expected.dtype)
        if wide.bits <= narrow.bits or wide.max < narrow.max or wide.resolution > narrow.resolution:
            return False
    return torch.equal(rows, expected.to(rows.dtype))


def vllm_parameters(model: Any) -> dict[str, torch.Tensor]:
    """CPU copies of a vLLM model's parameters (run in vLLM's worker by ``LLM.apply_model``)."""
    out = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if getattr(experts, "isa", None) is not None and not getattr(experts, "_use_zentorch", False):
            out.update(unpacked_experts(prefix, module, experts))
        inputs = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
        if weight is None or method is None or inputs is None or weight.numel():
            continue
        eye = torch.eye(inputs, dtype=getattr(module, "params_dtype", weight.dtype), device=weight.device)
        with torch.no_grad():
            out[f"{prefix}.weight"] = method.apply(module, eye, None).t().contiguous().cpu()  # [out, in]
    return out


def unpacked_experts(prefix: str, layer: Any, experts: Any) -> dict[str, torch.Tensor]:
    """A CPU fused-MoE layer's ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` as they were before
    ``cpu_prepack_moe_weight`` (with the experts' ``isa``) packed them. The packing moves elements
    only, the same way in every expert: packing each digit (base 256, exact in bf16) of every element's
    index tells where each one went."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    out = {}
    intermediate = experts.moe_config.intermediate_size_per_partition
    for name in ("w13_weight", "w2_weight"):
        packed = getattr(layer, name).detach().cpu()
        count = packed[0].numel()
        index, source, scale = torch.arange(count), torch.zeros(count, dtype=torch.long), 1
        while scale < count:
            digit = (index // scale % 256).to(packed.dtype).view(1, *packed.shape[1:])
            source += cpu_prepack_moe_weight(digit, experts.isa).flatten().long() * scale
            scale *= 256
        weight = torch.empty_like(packed).view(len(packed), -1)
        weight[:, source] = packed.view(len(packed), -1)
        weight = weight.view(packed.shape)
        if name == "w13_weight":  # [gate; pad; up; pad] -> [gate; up]
            padded = weight.shape[1] // 2
            weight = torch.cat([weight[:, :intermediate], weight[:, padded:padded + intermediate]], 1)
        else:
            weight = weight[..., :intermediate]
        out[f"{prefix}.{name}"] = weight.contiguous()
    return out


class _Parameters:
    def __init__(self, parameters: dict[str, torch.Tensor]) -> None:
        self._parameters = parameters

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._parameters.items())


class InspectableVLLMEngine(VLLMEngine):
    """``VLLMEngine`` with a ``.model`` whose ``named_parameters()`` are copies of what vLLM holds."""

    @property
    def model(self) -> _Parameters | None:
        llm = getattr(self, "llm", None)
        return None if llm is None else _Parameters(llm.apply_model(vllm_parameters)[0])
