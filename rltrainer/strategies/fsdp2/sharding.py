"""FSDP2's layout on one rank: ``fully_shard`` a transformers model (:func:`shard_model`), fill this
rank's rows from a weight source (:func:`load_shards`), measure a shard (:func:`shard_bytes`)."""

from __future__ import annotations

from typing import Any

import torch

from rltrainer.models import RandomInit, parameter_aliases, persistent_buffers, source_key
from rltrainer.models.build import WeightSource
from rltrainer.models.support import check_activation_checkpointing, fsdp_blocks
from rltrainer.process_groups import host_group


def enable_activation_checkpointing(name: str, model: torch.nn.Module) -> None:
    """transformers' non-reentrant activation checkpointing (renamed in transformers 5)."""
    check_activation_checkpointing(model, name)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(f"activation_checkpointing needs a transformers model; {name} is {type(model).__name__}")



def load_shards(label: str, model: torch.nn.Module, source: WeightSource,
                built: dict[str, torch.Tensor], rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """Fill this rank's rows of every parameter of ``model`` (the module's ``label``; sharded, just materialised by
    ``to_empty``): a checkpoint's rows are read here, a random init's are scattered from rank 0 (a
    collective: every rank calls it), a parameter ``configure_model`` added in full (``built``) is
    copied. Raises before anything moves if the source lacks a tensor or has another shape. The
    buffers a checkpoint stores (:func:`~rltrainer.models.persistent_buffers`) are read whole, on
    every rank; a random init's are the ones every rank built."""
    import torch.distributed as dist

    aliases = parameter_aliases(model)  # a tied weight has several names
    params = [(name, param) for name, param in model.named_parameters() if name not in built]  # from the source
    scatter = isinstance(source, RandomInit)
    keys: dict[str, str] = {}  # parameter -> its tensor in the source
    error = None
    if not scatter or rank == 0:  # a random init is known to rank 0 only
        try:
            keys = {name: source_key(source, aliases[name], tuple(p.shape)) for name, p in params}
        except (KeyError, ValueError) as e:
            error = str(e.args[0])
    if scatter and world_size > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0, group=host_group())  # every rank raises, none waits in a scatter
        error = shared[0]
    if error:
        raise ValueError(f"Cannot load {label}: {error}")
    report = {"source": f"safetensors files in {source.path}" if not scatter else "random init on rank 0",
              **shard_bytes(model, rank, world_size), "loaded_bytes": 0}
    before = 0 if scatter else source.bytes_read
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, start = _local_rows(param, rank, world_size)
            stop = start + (local.shape[0] if local.dim() else 0)
            if name in built:
                local.copy_(built[name][start:stop] if local.dim() else built[name])
                continue
            if not scatter and local.dim() and not local.shape[0]:
                continue  # an empty last shard
            if scatter:
                _scatter_rows(local, param.shape, source.read(keys[name]) if rank == 0 else None, world_size, device)
            else:
                source.read(keys[name], start, stop if local.dim() else None, out=local)
            report["loaded_bytes"] += local.numel() * local.element_size()
        if not scatter:
            report["read_bytes"] = source.bytes_read - before  # of the files: the parameters' rows only
            stored = source.names()
            for name, buffer in persistent_buffers(model).items():  # as from_pretrained loads them: whole
                if name in stored:
                    source.read(name, out=buffer)
    return report


def _local_rows(param: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """This rank's part of ``param`` and the first row it holds (fully_shard: chunks of
    ``ceil(rows / world_size)`` rows along dim 0, the last ones shorter or empty)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.detach(), 0
    local = param.detach().to_local()
    return local, (rank * -(-param.shape[0] // world_size) if param.dim() else 0)


def _scatter_rows(local: torch.Tensor, shape: torch.Size, full: torch.Tensor | None, world_size: int,
                  device: torch.device) -> None:
    """Rank 0 holds ``full``; each rank receives its rows into ``local`` (one scatter; chunks padded
    to the same length; a 0-dim tensor is broadcast)."""
    import torch.distributed as dist

    if world_size == 1:
        local.copy_(full)
        return
    if not shape:
        buffer = full.to(device, local.dtype) if full is not None else torch.empty((), dtype=local.dtype, device=device)
        dist.broadcast(buffer, src=0)
        local.copy_(buffer)
        return
    chunk = -(-shape[0] // world_size)
    out = torch.empty((chunk, *shape[1:]), dtype=local.dtype, device=device)
    pieces = None
    if full is not None:
        padded = torch.zeros((chunk * world_size, *shape[1:]), dtype=local.dtype, device=device)
        padded[: shape[0]].copy_(full)
        pieces = list(padded.chunk(world_size))
    dist.scatter(out, pieces, src=0)
    local.copy_(out[: local.shape[0]])


def shard_bytes(model: torch.nn.Module, rank: int, world_size: int) -> dict[str, int]:
    """Bytes of ``model``'s parameters in full, and of this rank's shard of them."""
    full = local = 0
    for param in model.parameters():
        full += param.numel() * param.element_size()
        part = _local_rows(param, rank, world_size)[0]
        local += part.numel() * part.element_size()
    return {"full_bytes": full, "shard_bytes": local}


def shard_model(model: torch.nn.Module, mesh: Any, precision: str, cpu_offload: bool,
                reshard_after_forward: bool) -> None:
    """``fully_shard`` each transformer block (``_no_split_modules`` of a transformers model), then
    the root (embeddings, final norm and a tied LM head stay together in the root's group)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = {"bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          "16-mixed": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)}.get(
        precision, MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload, "reshard_after_forward": reshard_after_forward}
    for block in fsdp_blocks(model, type(model).__name__):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if any(p.requires_grad for p in model.parameters()):
        # policy_step normalises by global counts: sum gradients across ranks instead of averaging.
        # The setting is per FSDP unit, so set it on every sharded block and the root.
        for sub in model.modules():
            if hasattr(sub, "set_gradient_divide_factor"):
                if hasattr(sub, "set_force_sum_reduction_for_comms"):
                    sub.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
                sub.set_gradient_divide_factor(1.0)
