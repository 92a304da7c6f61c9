"""vLLM's side of a weight sync, through vLLM's public weight-transfer API.

vLLM (0.32 and 0.33 alike) updates weights in sessions: ``LLM.start_weight_update()``, one
``LLM.update_weights(...)`` per chunk, ``LLM.finish_weight_update()``. Each call goes through the
executor's ``collective_rpc`` to the worker's :class:`~vllm.distributed.weight_transfer.base.WeightTransferEngine`,
chosen by ``LLM(weight_transfer_config={"backend": ...})`` from vLLM's
``WeightTransferEngineFactory``, whose registry takes backends of other libraries by name.

vLLM's own backends move the bytes themselves (``nccl``: a broadcast from the trainer; ``ipc``:
CUDA IPC handles); :mod:`rltrainer.weights` has already moved them into this process (a
broadcast, a shared-memory slot, Ray's object store), so :class:`LocalWeightTransferEngine`
takes the tensors as they are. Loading is what vLLM's ``ipc`` backend does: the session runs
vLLM's layerwise reload (``initialize_layerwise_reload`` at the start, the model's own
``load_weights`` per chunk, ``finalize_layerwise_reload`` at the end), which restores each layer
to its checkpoint form, buffers what arrives and re-runs the layer's post-load processing once
all of its tensors are in (the CPU build repacks linear weights there). So a fused layer
(``qkv_proj``, ``gate_up_proj``) may arrive over several chunks of one session, but it must arrive
whole: a layer given only some of its tensors is rebuilt from those alone
(:meth:`~rltrainer.rollout.vllm.VLLMEngine.weight_groups` tells the sender which names go together,
and :mod:`rltrainer.rollout.vllm_weights` puts them in checkpoint form first).

One post-load step vLLM 0.32 leaves out of a reload: the CPU build's fused-MoE kernel
(``cpu_fused_moe``) reads a layer's ``w13_weight`` / ``w2_weight`` in the blocked layout
``cpu_prepack_moe_weight`` writes, and vLLM packs them when the engine starts (the experts'
``process_weights_after_loading``), but on a weight update ``UnquantizedFusedMoEMethod._setup_kernel``
only copies the checkpoint-layout tensors in and skips that step (``fused_moe/unquantized_fused_moe_method.py``,
``if not is_weight_update``). The kernel then reads the experts' weights scrambled: a tiny fp32
Qwen3-MoE's log-probs were 0.023 from the trainer's (Mixtral 0.063), 1e-6 once packed.
:func:`pack_cpu_experts_on_reload` adds the step back.

This module imports vLLM; :mod:`rltrainer.rollout.vllm` imports it only when an engine is set up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "rltrainer_local"


@dataclass
class LocalInitInfo(WeightTransferInitInfo):
    """Nothing to connect: the tensors are in this process already."""


@dataclass
class LocalUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: ``(hf_name, tensor)`` pairs in the policy's (checkpoint) names."""

    weights: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class LocalWeightTransferEngine(WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
    """Loads chunks of tensors already in the worker's process, in one layerwise-reload session."""

    init_info_cls = LocalInitInfo
    update_info_cls = LocalUpdateInfo

    def init_transfer_engine(self, init_info: LocalInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: LocalUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(update_info.weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


class _UnchangedLayers(logging.Filter):
    """vLLM warns "<Layer>: Failed to load weights" for each layer a reload session gave nothing; a
    sync sends only what changed (and a rotary embedding never has weights), so those layers keep
    theirs on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


def register() -> str:
    """Register the backend in this process (once); returns its name for ``weight_transfer_config``."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, LocalWeightTransferEngine)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_UnchangedLayers())
    except ValueError:  # registered by an earlier engine in this process
        pass
    return BACKEND


def model_facts(model: Any) -> dict[str, Any]:
    """What the adapter needs to know of the worker's model (run through ``LLM.apply_model``):
    whether the LM head keeps weights of its own beside the input embedding (the CPU build does,
    even when the config ties them)."""
    inner = getattr(model, "model", None)
    head, embed = getattr(model, "lm_head", None), getattr(inner, "embed_tokens", None)
    return {"separate_lm_head": head is not None and embed is not None and head is not embed}


def pack_cpu_experts_on_reload(model: Any) -> int:
    """Make every CPU fused-MoE layer pack its experts again when a weight update reloads it (run
    once, through ``LLM.apply_model``, on the CPU build); returns how many layers it covers.

    Each layer's ``quant_method.process_weights_after_loading``, which vLLM's layerwise reload calls
    once the layer's tensors are in, gets the experts' own ``process_weights_after_loading`` (pad
    the intermediate size, ``cpu_prepack_moe_weight``) after it, as at start-up; the reload then
    copies the packed tensors into the kernel's. Only where vLLM did not run that step itself during
    the call (a vLLM that fixes this is left alone: packing twice would scramble the weights again),
    and not for weights vLLM was told are already in runtime form."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    layers = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and "process_weights_after_loading" not in vars(method):
            method.process_weights_after_loading = _packing_experts(method.process_weights_after_loading, experts)
            layers += 1
    return layers


def _packing_experts(process: Any, experts: Any) -> Any:
    """``process`` (the method's ``process_weights_after_loading``), then ``experts``' own unless
    ``process`` called it."""
    from vllm.model_executor.utils import is_weights_pre_processed

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        packed: list[bool] = []
        pack = experts.process_weights_after_loading

        def packing(layer: torch.nn.Module) -> None:
            packed.append(True)
            pack(layer)

        experts.process_weights_after_loading = packing  # seen if vLLM packs by itself
        try:
            process(layer)
        finally:
            del experts.process_weights_after_loading  # the class's method again
        if not packed and not is_weights_pre_processed():
            pack(layer)

    return process_weights_after_loading
