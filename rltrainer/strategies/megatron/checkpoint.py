"""A megatron checkpoint that loads on any layout: the models' parameters and the optimizer's state
are stored as whole tensors under their Hugging Face names, so a checkpoint saved with one tensor,
pipeline and data-parallel size loads with any other (TP=2 -> TP=1 and back, PP and DP likewise).

The checkpoint's ``training/`` directory::

    state.pt                      (rank 0) the format, the optimizer's step, its param groups'
                                  hyperparameters and the LR schedulers, read with weights_only=True
    rank=<r>-<k>.safetensors      the tensors rank ``r`` wrote, at most ``bucket_bytes`` per file, named
                                  ``<model>/<kind>/<HF name>``: kind ``weight`` (the model's parameters),
                                  ``exp_avg`` / ``exp_avg_sq`` (Adam) or ``momentum_buffer`` (SGD) once the
                                  optimizer has stepped, and ``main_param`` (the fp32 copy of a bf16 parameter)

Saving (a collective), parameter by parameter: with megatron's distributed optimizer, each
data-parallel rank's slice of the optimizer state is summed into the whole tensor over the
data-parallel group (a mixture of experts' expert weights: over their expert-data-parallel group,
then stacked, each layer's local experts together, and gathered over the expert-parallel group
into the fused HF tensor); the tensor-parallel slices are all-gathered; the exact layout functions
(:func:`~rltrainer.strategies.megatron.layouts.hf_from_megatron`) turn them into HF tensors, and
one rank of the stage keeps each for its next file (the one that has written the fewest bytes so
far). So every rank writes about an equal part of its stage, and none holds more than about one
whole tensor and one file's bucket.

Loading: each rank reads only its shard of each tensor (its stage, its rows) from the files'
headers and byte ranges, with :func:`~rltrainer.strategies.megatron.layouts.megatron_shard`, as it
reads a Hugging Face checkpoint at setup, and puts the optimizer state of its slice in place.

Why not megatron-core's ``dist_checkpointing``: on 0.16.1 its ``torch_dist`` backend places shards on
``cuda`` and reads its common state with ``torch.load`` unpickling, and the distributed optimizer's
reshardable formats go through its own planners; HF names reuse the layout functions every
weight load and sync already checks, need no CUDA, and read without unpickling.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rltrainer.checkpoints import CheckpointError, check_state_matches, safe_load, save_file
from rltrainer.files import reporting_disk_full
from rltrainer.models.safetensors_io import SafetensorsWeights, write_safetensors
from rltrainer.process_groups import host_group
from rltrainer.strategies.megatron.layouts import (MegatronLayout, Reader, Rows, expert_stack, hf_from_megatron,
                                                   megatron_shard, state_reader)
from rltrainer.strategies.megatron.models import MegatronValueModel, critic_trunk_config

FORMAT = "rltrainer-megatron-hf-layout"
STATE_FILE = "state.pt"
MOMENTS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class ModelTensors:
    """One trainable model on this rank: its megatron parameters, and their HF tensors both ways."""

    def __init__(self, model: torch.nn.Module, layout: MegatronLayout, stage: int, tp_rank: int,
                 ep_rank: int = 0) -> None:
        self.model, self.layout, self.stage, self.tp_rank, self.ep_rank = model, layout, stage, tp_rank, ep_rank
        self.critic = isinstance(model, MegatronValueModel)
        self.config = critic_trunk_config(model.config) if self.critic else model.config

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.model.named_parameters())

    def units(self) -> list[tuple[str, list[torch.nn.Parameter] | None]]:
        """What becomes whole HF tensors, in order: ``(name, None)`` for a parameter alone, and
        ``(stack, params)`` for a mixture of experts' expert weights, their layer's local experts in
        order (``gpt.`` + the stack's name, see :func:`~rltrainer.strategies.megatron.layouts.expert_stack`)."""
        units: dict[str, list[tuple[int, torch.nn.Parameter]] | None] = {}
        for name, param in self.params():
            stack = expert_stack(name.removeprefix("gpt."))
            if stack is None:
                units[name] = None
            else:
                units.setdefault("gpt." + stack[0], []).append((stack[1], param))
        return [(name, None if parts is None else [p for _, p in sorted(parts, key=lambda part: part[0])])
                for name, parts in units.items()]

    def to_hf(self, name: str, tp_parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s tensor-parallel slices (or anything shaped like them) -> whole HF tensors."""
        if name.startswith(("norm.", "score.")):  # a critic's replicated head
            return {_head_name(name): tp_parts[0]}
        return hf_from_megatron(name.removeprefix("gpt."), tp_parts, self.config, self.layout, self.stage)

    def shard(self, read: Reader) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of every parameter, by name, from HF tensors ``read`` returns."""
        for name, tensor in megatron_shard(read, self.config, self.layout, self.stage, self.tp_rank, self.ep_rank):
            if not (self.critic and name == "decoder.final_layernorm.weight"):  # outside the trunk
                yield "gpt." + name, tensor
        if self.critic:
            for name, _ in self.params():
                if name.startswith(("norm.", "score.")):
                    yield name, read(_head_name(name), None)


def _head_name(name: str) -> str:
    return "model." + name if name.startswith("norm.") else name


class _Writer:
    """The tensors this rank keeps, written as ``rank=<r>-<k>.safetensors`` every ``bucket_bytes``."""

    def __init__(self, directory: Path, rank: int, bucket_bytes: int) -> None:
        self.directory, self.rank, self.bucket_bytes = directory, rank, bucket_bytes
        self.bucket: list[tuple[str, torch.Tensor]] = []
        self.size = self.files = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.bucket.append((name, tensor.detach().to("cpu", copy=True).contiguous()))
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        if self.bucket:
            path = self.directory / f"rank={self.rank}-{self.files:05d}.safetensors"
            with reporting_disk_full(path, f"rank {self.rank}'s tensors", self.size):
                write_safetensors(path, self.bucket)
            self.files += 1
        self.bucket, self.size = [], 0


def save(directory: Path, models: dict[str, ModelTensors], optimizer: Any, schedulers: list[Any],
         rank: int, bucket_bytes: int) -> None:
    """Write this rank's part of the checkpoint into ``directory`` (a collective: every rank calls it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    slots, config = optimizer.state_slots(), optimizer.config
    step = _global_step(optimizer)
    kinds = (["main_param"] if config.bf16 else []) + (list(MOMENTS[config.optimizer]) if step else [])
    if config.optimizer == "sgd" and not any(g.get("momentum", 0) for g in optimizer.megatron.param_groups):
        kinds = [k for k in kinds if k != "momentum_buffer"]  # plain SGD keeps no state
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    me = parallel_state.get_data_parallel_rank() * tp + tp_rank  # every rank of the stage holds each whole tensor
    written = [0] * (tp * parallel_state.get_data_parallel_world_size())  # bytes per rank of the stage, alike on each
    writer = _Writer(directory, rank, bucket_bytes)
    for model_name, tensors in models.items():
        params = dict(tensors.params())
        for name, experts in tensors.units():
            group = experts or [params[name]]  # a parameter, or a layer's local experts
            # every rank alike (collectives), whether it steps a slice of the parameter or not
            for kind in ["weight", *kinds] if group[0].requires_grad else ["weight"]:
                parts = [param.detach() if kind == "weight" else _model_space(
                    param, slots.get(id(param)), kind, config.use_distributed_optimizer) for param in group]
                local = parts[0] if experts is None else gather_experts(torch.stack(parts))  # [E, ...]
                for hf, tensor in tensors.to_hf(name, _tp_gather(local, tp)).items():
                    owner = written.index(min(written))  # the rank of the stage that has written least
                    written[owner] += tensor.numel() * tensor.element_size()
                    if owner == me:
                        writer.add(f"{model_name}/{kind}/{hf}", tensor)
    writer.flush()
    groups: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(groups, optimizer.group_hyperparameters(), group=host_group())
    if rank == 0:
        state = {"format": FORMAT, "step": step, "kinds": kinds, "models": sorted(models),
                 "groups": {tag: g for part in groups for tag, g in part.items()},
                 "schedulers": [s.state_dict() for s in schedulers]}
        save_file(state, directory / STATE_FILE, "the optimizer groups and schedulers")


def _global_step(optimizer: Any) -> float:
    """The optimizer's step count (0 before its first step), the same on every rank (a rank may
    step nothing). A host tensor: reduced over :func:`~rltrainer.process_groups.host_group`."""
    import torch.distributed as dist

    value = torch.tensor([optimizer.step_count()], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=host_group())
    return float(value)


def _model_space(param: torch.Tensor, slot: tuple[Any, torch.Tensor, slice | None] | None, kind: str,
                 distributed: bool) -> torch.Tensor:
    """``param``'s optimizer state ``kind`` (or its fp32 main copy) on this tensor-parallel rank, whole:
    with the distributed optimizer each data-parallel rank holds a slice of it (``slot``; ``None``: none
    here), summed over the group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    flat = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if slot is not None:
        inner, main, rows = slot
        value = (main if kind == "main_param" else inner.state[main][kind]).detach().reshape(-1)
        flat[rows if rows is not None else slice(None)] = value
    if distributed:  # an expert-parallel expert's state is sharded over its expert-data-parallel group
        expert = not getattr(param, "allreduce", True)  # as megatron's DDP and optimizer tell them apart
        dist.all_reduce(flat, group=parallel_state.get_expert_data_parallel_group() if expert
                        else parallel_state.get_data_parallel_group())
    return flat.view(param.shape)


def gather_experts(local: torch.Tensor) -> torch.Tensor:
    """A layer's local experts' stack ``[E / ep, ...]`` -> all of its experts ``[E, ...]``, over the
    expert-parallel group (in its rank order, which is the experts' order)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep == 1:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local, group=parallel_state.get_expert_model_parallel_group())
    return torch.cat(parts)


def _tp_gather(local: torch.Tensor, tp: int) -> list[torch.Tensor]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if tp == 1:
        return [local]
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
    return parts


# -- loading -------------------------------------------------------------------------------------------
def read_state(directory: Path) -> dict[str, Any]:
    """The checkpoint's ``state.pt``, after checking it is this format's."""
    file = directory / STATE_FILE
    if not file.is_file():
        found = sorted(p.name for p in directory.iterdir())[:6] if directory.is_dir() else []
        old = " (rank=<r>.pt files: an earlier rltrainer's megatron format, which this one does not read)" \
            if any(n.startswith("rank=") and n.endswith(".pt") for n in found) else ""
        raise CheckpointError(f"{directory} should hold a megatron checkpoint ({STATE_FILE} and rank=*.safetensors), "
                              f"but it has {found or 'nothing'}{old}: the save did not finish, or another strategy "
                              "wrote it. Resume it with the strategy that saved it.")
    state = safe_load(file, "a megatron checkpoint's optimizer step, param groups and LR schedulers")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} state file (found {type(state).__name__}).")
    return state


def load(directory: Path, models: dict[str, ModelTensors], hf_shapes: dict[str, dict[str, tuple[int, ...]]],
         optimizer: Any, schedulers: list[Any], optimizer_state: bool = True) -> None:
    """Fill this rank's shards of ``models`` and its slice of ``optimizer``'s state from a checkpoint
    saved on any layout. ``hf_shapes``: each model's HF tensor shapes, checked against the saved ones
    first (a mismatch raises :class:`~rltrainer.checkpoints.CheckpointError`). Without
    ``optimizer_state`` the optimizer starts afresh on the loaded weights instead
    (:meth:`~rltrainer.strategies.megatron.optimizer.MegatronOptimizer.reset_state`)."""
    state = read_state(directory)
    if sorted(models) != state["models"]:
        raise CheckpointError(f"{directory} holds the models {state['models']}; this module trains {sorted(models)}.")
    files = SafetensorsWeights(str(directory))
    saved = {name: entry[3] for name, entry in files.names().items()}
    for model_name in models:
        prefix = f"{model_name}/weight/"
        check_state_matches(f"{directory} ({model_name})", hf_shapes[model_name],
                            {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})
    with torch.no_grad():
        for model_name, tensors in models.items():
            params = dict(tensors.params())
            for name, tensor in tensors.shard(_reader(files, f"{model_name}/weight/", hf_shapes[model_name])):
                params[name].copy_(tensor)
        if optimizer_state:
            _load_optimizer(directory, files, state, models, hf_shapes, optimizer)
    if optimizer_state:
        optimizer.load_group_hyperparameters(state["groups"])
    else:
        optimizer.reset_state()
    if len(state["schedulers"]) != len(schedulers):
        raise CheckpointError(f"{directory} holds {len(state['schedulers'])} LR scheduler(s); configure_optimizers() "
                              f"returned {len(schedulers)}.")
    for sched, s in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(s)


def _load_optimizer(directory: Path, files: Any, state: dict[str, Any], models: dict[str, ModelTensors],
                    hf_shapes: dict[str, dict[str, tuple[int, ...]]], optimizer: Any) -> None:
    """Put each saved state tensor's slice where this rank's optimizer keeps it (its state created
    first if it has not stepped yet)."""
    slots = optimizer.state_slots()
    moments = [k for k in state["kinds"] if k != "main_param"]
    if moments:
        optimizer.init_state(state["step"], moments)
    for kind in state["kinds"]:
        for model_name, tensors in models.items():
            params = dict(tensors.params())
            for name, tensor in tensors.shard(_reader(files, f"{model_name}/{kind}/", hf_shapes[model_name])):
                param = params[name]
                if not param.requires_grad or id(param) not in slots:
                    continue
                if tensor.is_meta:
                    raise CheckpointError(f"{directory} has no {kind} for {model_name}'s {name}, which this run "
                                          "trains: the checkpoint is incomplete or froze other parameters.")
                inner, main, rows = slots[id(param)]
                target = main if kind == "main_param" else inner.state[main][kind]
                source = tensor.reshape(-1) if rows is None else tensor.reshape(-1)[rows]
                target.copy_(source.reshape(target.shape))


def _reader(files: Any, prefix: str, shapes: dict[str, tuple[int, ...]]) -> Reader:
    """A layouts :data:`Reader` over the saved tensors named ``prefix + HF name``; a tensor not saved
    (a frozen parameter's optimizer state) reads as a meta tensor of its shape."""
    missing = state_reader({n: torch.empty(s, device="meta") for n, s in shapes.items()})

    def read(name: str, rows: Rows) -> torch.Tensor:
        if prefix + name not in files.names():
            return missing(name, rows)
        return files.read(prefix + name) if rows is None else files.read(prefix + name, *rows)

    return read
