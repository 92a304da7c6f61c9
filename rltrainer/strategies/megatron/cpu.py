"""megatron-core on CPU ranks (tests, laptops): megatron-core assumes CUDA in a few places; these
make a CPU-only process run it unchanged. Active only on CPU ranks (see :func:`cpu_placement`)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def cpu_shims() -> None:
    """megatron-core places some tensors with ``torch.cuda.current_device()`` (RoPE frequencies,
    the global memory buffer, pipeline receive buffers, the MoE router's weight and the all-to-all
    dispatcher's receive buffers) and synchronises after pipeline sends; in a CPU-only worker
    process, make those the CPU and a no-op. The MoE all-to-all dispatcher copies its token counts
    to the host on a side stream (``token_dispatcher.py:444-445, 862-899``: ``torch.cuda.Stream()``,
    ``current_stream``, ``stream``, ``record_event().synchronize()``): on a CPU the counts are
    there already, so the stream is one that does nothing."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]


class _HostStream:
    """A CUDA stream's calls megatron-core's MoE dispatcher makes, on a CPU: nothing to order or wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return SimpleNamespace(synchronize=lambda: None)


_HOST_STREAM = _HostStream()


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



def host_split_sizes(gpt: torch.nn.Module) -> None:
    """On a CPU, make each all-to-all MoE dispatcher of ``gpt`` hold its split sizes as megatron-core
    holds them on a GPU. Its ``_maybe_dtoh_and_synchronize`` copies the per-rank token counts to
    the host as numpy arrays with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts
    only CUDA tensors (``moe_utils.py:1093-1099``); counted on a CPU they stay tensors, which
    ``torch.distributed.all_to_all_single`` refuses as split sizes ("incompatible function
    arguments"). After each call, the counts become the numpy arrays the GPU path makes."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    for module in gpt.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
            continue

        def on_host(point: str, tokens_per_expert: torch.Tensor | None = None, dispatcher: Any = dispatcher,
                    original: Any = dispatcher._maybe_dtoh_and_synchronize) -> Any:
            out = original(point, tokens_per_expert)
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(dispatcher, name)
                if isinstance(value, torch.Tensor):
                    setattr(dispatcher, name, value.numpy())
            return out

        dispatcher._maybe_dtoh_and_synchronize = on_host
