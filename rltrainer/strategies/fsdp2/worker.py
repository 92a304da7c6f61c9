"""The rank side of ``strategy="fsdp2"``: :class:`FSDP2Worker` (setup on the meta device, sharding,
loading each rank's rows, gathering full weights for a sync, sharded checkpoints)."""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.files import reporting_disk_full
from rltrainer.models import RandomInit, deferred_init, share_rng_state, state_tensors, take_weight_source
from rltrainer.models.build import WeightSource
from rltrainer.models.support import check_causal_lm, check_fast_paths
from rltrainer.process_groups import host_group
from rltrainer.strategies.fsdp2.checkpoint import load_sharded, save_sharded
from rltrainer.strategies.fsdp2.sharding import enable_activation_checkpointing, load_shards, shard_bytes, shard_model
from rltrainer.strategies.rank_worker import TrainingWorker
from rltrainer.strategies.strategy import normalize_optimizers, reset_optimizer
from rltrainer.weights.shm import SharedBuffers
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, Entry, bucket_entries, bucket_nbytes, bucket_views

if TYPE_CHECKING:
    from rltrainer.module import RLModule

log = logging.getLogger(__name__)


class FSDP2Worker(TrainingWorker):
    """One FSDP2 training rank (and, colocated, one rollout engine replica)."""

    def __init__(self, rank: int, world_size: int, threads: int | None = None, device: str = "auto",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(rank, world_size, threads=threads, device=device, bucket_bytes=bucket_bytes)
        self.shared: SharedBuffers | None = None
        self.loaded: dict[str, dict[str, Any]] = {}
        self.pending_save: Future | None = None  # an asynchronous checkpoint write
        self.pending_dir = Path()  # and where it writes

    # -- setup -----------------------------------------------------------------------------------
    def setup(self, module: RLModule, options: dict[str, Any], seed: int) -> None:
        """``configure_model`` with the same seed on every rank, inside
        :func:`~rltrainer.models.deferred_init`: the models it builds with ``build_causal_lm`` have
        their parameters on the meta device. Each model is sharded (:func:`shard_model`), then every
        rank fills only its own rows (:func:`load_shards`): read from the checkpoint's safetensors
        files, or, for a random init, scattered from rank 0, which alone runs it (in full, with the
        draws every rank made before, so the same seed gives the same weights and, shared after it,
        the same RNG state). A model built in full (a callable spec, a model the hook loads itself)
        is sharded as it is. Then ``configure_optimizers`` over the sharded (DTensor) parameters."""
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(seed)
        with deferred_init(init_random_here=self.rank == 0):
            module.configure_model()
        if getattr(module, "policy", None) is None:
            raise RuntimeError(f"{type(module).__name__}.configure_model() must set self.policy")
        check_causal_lm(module.policy, "fsdp2")
        self.options = options
        if options["precision"] == "bf16-true":
            module.to(torch.bfloat16)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        trainable = module.trainable_models()
        self.models = {name: child for name, child in module.named_children() if any(True for _ in child.parameters())}
        random_init = False
        for name, model in self.models.items():
            if options["activation_checkpointing"] and name in trainable:
                enable_activation_checkpointing(name, model)
            source = take_weight_source(model)
            random_init |= isinstance(source, RandomInit)
            self.loaded[name] = self._place(name, model, source, mesh)
        if random_init and self.world_size > 1:
            share_rng_state()
        if self.rank == 0:
            for name, r in self.loaded.items():
                log.info("%s: %s, rank 0 holds %.3g of %.3g GB (%.3g GB read or received)", name, r["source"],
                         r["shard_bytes"] / 1e9, r["full_bytes"] / 1e9, r["loaded_bytes"] / 1e9)
        self.module = module
        check_fast_paths(module.policy, "fsdp2", options["padding_free"])  # a forward on every rank
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())

    def _place(self, name: str, model: torch.nn.Module, source: WeightSource | None,
               mesh: Any) -> dict[str, Any]:
        """Shard ``model`` and give this rank its rows; returns what :meth:`load_report` shows."""
        o = self.options
        shard = (mesh, o["precision"], o["cpu_offload"], o["reshard_after_forward"])
        if not any(p.is_meta for p in model.parameters()):  # built in full on every rank
            model.to(self.device)
            shard_model(model, *shard)
            report = shard_bytes(model, self.rank, self.world_size)
            return {"source": "built in full", **report, "loaded_bytes": report["full_bytes"]}
        on_meta = [n for n, b in model.named_buffers() if b.is_meta]
        if source is None or on_meta:
            raise RuntimeError(
                f"{name} has parameters on the meta device but no weights to load "
                f"({'buffers ' + ', '.join(on_meta[:4]) + ' are on meta too' if on_meta else 'no weight source'}): "
                "build it with rltrainer.models.build_causal_lm (a hub id, a path or a config) and assign it "
                "directly in configure_model, or build it in full.")
        buffers = dict(model.named_buffers())  # computed at build time (RoPE), not loaded: kept
        built = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}  # added by configure_model
        shard_model(model, *shard)
        model.to_empty(device="cpu" if o["cpu_offload"] else self.device)  # this rank's rows only
        for key, buffer in buffers.items():
            owner, _, leaf = key.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer.to(self.device)
        return load_shards(name, model, source, built, self.rank, self.world_size, self.device)

    def load_report(self) -> dict[str, dict[str, Any]]:
        """Per model: where its weights came from (``source``), the bytes of the whole model
        (``full_bytes``), of this rank's shard (``shard_bytes``), and what this rank read from a
        checkpoint or received from rank 0 while loading (``loaded_bytes``; from a checkpoint also
        ``read_bytes``, the bytes read from its files for them: a MoE checkpoint that stores each
        expert on its own is read one expert at a time, only the experts of this rank's rows)."""
        return self.loaded

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.view is not None:
            return dict(self.view.specs)
        return {n: (tuple(t.shape), t.dtype) for n, t in state_tensors(self.module.policy).items()}

    def use_shared_memory(self, directory: str, tag: str) -> None:
        """Gather weights through shared memory (every rank on this node, CPU tensors)."""
        self.shared = SharedBuffers(directory, tag, self.rank)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        super().close()

    # -- weights -----------------------------------------------------------------------------------
    def gather_weights(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (bucket ``index``): through shared memory on one CPU node,
        else one async all-gather per DTensor with the whole bucket in flight. A LoRA policy's
        outputs (merged weights, adapters) are computed from their gathered sources."""
        if self.view is None:
            return self._gather_params(names, dtype, index, shared=True)
        full = dict(self._gather_params(self.view.sources(names), None, index, shared=False))
        return [(n, _local(self.view.tensor(n, full), dtype)) for n in names]

    def _gather_params(self, names: list[str], dtype: torch.dtype | None, index: int,
                       shared: bool) -> list[tuple[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        params = {n: t.detach() for n, t in state_tensors(self.module.policy).items()}  # persistent buffers too
        if self.world_size == 1 or not any(isinstance(params[n], DTensor) for n in names):
            return [(n, _local(params[n], dtype)) for n in names]
        if self.shared is not None and shared:
            return self._gather_shared(names, params, dtype, index)
        gathered, handles = [], []
        for name in names:
            param = params[name]
            if not isinstance(param, DTensor):
                gathered.append((name, _local(param, dtype), None))
                continue
            local = param.to_local().to(device=self.device, dtype=dtype or param.dtype)
            rows, chunk = param.shape[0], -(-param.shape[0] // self.world_size)
            if local.shape[0] != chunk:  # uneven last shard: pad to the common chunk
                local = torch.nn.functional.pad(local, [0, 0] * (local.dim() - 1) + [0, chunk - local.shape[0]])
            out = torch.empty((chunk * self.world_size, *param.shape[1:]), dtype=local.dtype, device=self.device)
            handles.append(_all_gather(out, local.contiguous()))
            gathered.append((name, out, rows))
        for handle in handles:
            handle.wait()
        return [(name, t if rows is None else t[:rows]) for name, t, rows in gathered]

    def _gather_shared(self, names: list[str], params: dict[str, Any], dtype: torch.dtype | None,
                       index: int) -> list[tuple[str, torch.Tensor]]:
        """Each rank writes its rows of each tensor into the node's shared buffer, in wire layout;
        after a barrier every rank reads the full tensors (views, valid until bucket ``index + 2``)."""
        entries = bucket_entries((n, tuple(params[n].shape), dtype or params[n].dtype) for n in names)
        buffer = self.shared.get(index, bucket_nbytes(entries))
        self._write_rows(params, entries, buffer)
        views = dict(bucket_views(buffer, entries))
        return [(n, views[n]) for n in names]

    def gather_weights_into(self, names: list[str], dtype: torch.dtype | None, index: int, entries: list[Entry],
                            out: torch.Tensor) -> bool:
        """With the shared-memory gather (one CPU node), every rank writes its rows straight into the
        transport's slot: the bucket is on the wire without another copy."""
        if self.shared is None or self.world_size == 1 or self.view is not None:
            return False
        self._write_rows({n: t.detach() for n, t in state_tensors(self.module.policy).items()}, entries, out)
        return True

    def _write_rows(self, params: dict[str, Any], entries: list[Entry], buffer: torch.Tensor) -> None:
        """This rank's rows of each DTensor (rank 0: each replicated tensor) into ``buffer`` at its
        wire offset, then a barrier: on return the buffer holds the whole bucket."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for name, full in bucket_views(buffer, entries):
            param = params[name]
            if isinstance(param, DTensor):
                local = param.to_local()
                first = self.rank * -(-param.shape[0] // self.world_size)
                full[first:first + local.shape[0]].copy_(local)
            elif self.rank == 0:
                full.copy_(param)
        dist.barrier(group=host_group())  # the buffer is host memory

    def end_of_sync(self) -> None:
        """Readers of the last bucket finish before the next sync writes the same buffer."""
        if self.shared is not None and self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=host_group())

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        """torch's ``clip_grad_norm_``; with ``cpu_offload`` the gradients are CPU shards, clipped
        by :func:`_clip_host_gradients`."""
        if self.options.get("cpu_offload"):
            return _clip_host_gradients(params, max_norm)
        return super().clip_gradients(params, max_norm)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """Full (unsharded) model and optimizer state on rank 0 (CPU); ``None`` on other ranks."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        trainable = self.module.trainable_models()
        models = {name: get_model_state_dict(m, options=opts) for name, m in trainable.items()}
        optimizers = [get_optimizer_state_dict(self._owner(opt), opt, options=opts) for opt in self.optimizers]
        if self.rank != 0:
            return None
        return {"models": models, "optimizers": optimizers, "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        for name, m in self.module.trainable_models().items():
            set_model_state_dict(m, state["models"][name], options=opts)
        for opt, osd in zip(self.optimizers, state["optimizers"]):
            set_optimizer_state_dict(self._owner(opt), opt, osd, options=opts)
        for sched, s in zip(self.schedulers, state["schedulers"]):
            sched.load_state_dict(s)
        self.versions.forget_synced()

    def save_checkpoint(self, directory: str, async_save: bool = False) -> None:
        """This rank's shards of every trainable model and optimizer, with the schedulers, into
        ``directory`` (torch.distributed.checkpoint; a collective). Nothing is gathered. With
        ``async_save`` the shards are copied to host memory and written in a background thread
        (:meth:`wait_checkpoint` waits)."""
        self.wait_checkpoint()
        self.pending_save = save_sharded(self._sharded_state(), directory, async_save=async_save)
        self.pending_dir = Path(directory)

    def wait_checkpoint(self) -> None:
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            with reporting_disk_full(self.pending_dir, "this rank's shards (an asynchronous save)"):
                pending.result()

    def checkpoint_files(self, directory: str) -> list[str]:
        """DCP's files of this rank (``__<rank>_<k>.distcp``), and on rank 0 its ``.metadata``."""
        own = sorted(p.name for p in Path(directory).glob(f"__{self.rank}_*.distcp"))
        return own + [".metadata"] * (self.rank == 0)

    def load_checkpoint(self, directory: str, optimizer: bool = True) -> None:
        """Fill this rank's shards from a checkpoint saved on any number of ranks (DCP reshards);
        without ``optimizer`` the optimizers' saved state is not read and they start afresh."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        self.wait_checkpoint()
        state = self._sharded_state(optimizer)
        load_sharded(state, directory, state["models"])
        for name, m in self.module.trainable_models().items():
            set_model_state_dict(m, state["models"][name])
        for i, opt in enumerate(self.optimizers):
            if optimizer:
                set_optimizer_state_dict(self._owner(opt), opt, state["optimizers"][str(i)])
            else:
                reset_optimizer(opt)
        for i, sched in enumerate(self.schedulers):
            sched.load_state_dict(state["schedulers"][str(i)])
        self.versions.forget_synced()

    def _sharded_state(self, optimizers: bool = True) -> dict[str, Any]:
        """Models and optimizers (with ``optimizers``) as this rank's DTensor shards (FQN keys),
        schedulers as they are."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"models": {name: get_model_state_dict(m) for name, m in self.module.trainable_models().items()},
                 "schedulers": {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}}
        if optimizers:  # get_optimizer_state_dict gives a new optimizer its state (torch's _init_optim_state)
            state["optimizers"] = {str(i): get_optimizer_state_dict(self._owner(opt), opt)
                                   for i, opt in enumerate(self.optimizers)}
        return state

    def _owner(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        first = optimizer.param_groups[0]["params"][0]
        for model in self.module.trainable_models().values():
            if any(p is first for p in model.parameters()):
                return model
        raise RuntimeError("An optimizer holds parameters of no trainable model (trainable_models())")


def _clip_host_gradients(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip gradients kept on the host (``cpu_offload``) to the global 2-norm ``max_norm`` (if set)
    and return that norm. torch's ``clip_grad_norm_`` keeps it a DTensor on the gradients' device
    and all-reduces it over the mesh's group, NCCL on a GPU, which refuses CPU tensors
    (pytorch/pytorch#148532). Here each rank takes the norms of its own rows (``Shard(0)``: each
    element on one rank; a gradient that is not a DTensor counts on rank 0) and their squares are
    summed over :func:`~rltrainer.process_groups.host_group`."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    held = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in held]
    square = torch.zeros((), dtype=torch.float64)
    for grad, part in zip(held, local):
        if isinstance(grad, DTensor) or dist.get_rank() == 0:
            square += torch.linalg.vector_norm(part).double().square().cpu()
    dist.all_reduce(square, group=host_group())
    norm = float(square.sqrt())
    if max_norm and math.isfinite(norm) and max_norm < norm + 1e-6:
        with torch.no_grad():
            for part in local:
                part.mul_(max_norm / (norm + 1e-6))  # as clip_grad_norm_ scales
    return norm


def _local(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.to(dtype) if dtype else local


def _all_gather(out: torch.Tensor, local: torch.Tensor) -> Any:
    """Async all-gather of equal shards into one tensor (``all_gather_single`` where torch has it)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, local, async_op=True)
