"""megatron-core on CPU ranks (tests, laptops): megatron-core assumes CUDA in a few places; these
make a CPU-only process run it unchanged. Active only on CPU ranks (see :func:`cpu_placement`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def cpu_shims() -> None:
    """megatron-core places some tensors with ``torch.cuda.current_device()`` (RoPE frequencies,
    the global memory buffer, pipeline receive buffers) and synchronises after pipeline sends; in a
    CPU-only worker process, make those the CPU and a no-op."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


class _CUDAOnCPU(TorchFunctionMode):
    """Tensors that megatron-core creates with ``device="cuda"`` (the schedules' token counter, the
    optimizers' norm and scale tensors) or moves with ``.cuda()`` (the tied embedding's copy on the
    last stage) stay on the CPU.

    With ``type_names`` (only around megatron-core's DDP and optimizer calls, never around the
    hooks), ``tensor.type()`` of a CPU tensor answers with its CUDA name (``"torch.FloatTensor"`` ->
    ``"torch.cuda.FloatTensor"``): megatron-core's optimizers choose their fp32 or 16-bit path by
    that name and refuse any other (distrib_optimizer.py:361, 420, 582; optimizer.py:671, 690;
    clip_grads.py:167 asserts it of every gradient it clips)."""

    def __init__(self, type_names: bool = False) -> None:
        super().__init__()
        self.type_names = type_names

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and self.type_names and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cpu_placement(device: torch.device, type_names: bool = False) -> contextlib.AbstractContextManager:
    """Around megatron-core calls: on a CPU rank, CUDA placements become CPU ones (and, with
    ``type_names``, CPU tensors report CUDA type names; see :class:`_CUDAOnCPU`); on a GPU rank,
    nothing."""
    return _CUDAOnCPU(type_names) if device.type == "cpu" else contextlib.nullcontext()


def cpu_attention_spec() -> type:
    """A ``core_attention`` for CPU: causal SDPA over this rank's heads (grouped queries by repetition)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule

    class CPUAttention(MegatronModule):
        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
            super().__init__(config=config)
            tp = parallel_state.get_tensor_model_parallel_world_size()
            self.heads, self.groups = config.num_attention_heads // tp, config.num_query_groups // tp

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
            sq, b = query.shape[:2]  # [s, b, heads, d] -> [b, heads, s, d]
            q = query.permute(1, 2, 0, 3)
            k = key.permute(1, 2, 0, 3).repeat_interleave(self.heads // self.groups, dim=1)
            v = value.permute(1, 2, 0, 3).repeat_interleave(self.heads // self.groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(sq, b, -1)

    return CPUAttention

