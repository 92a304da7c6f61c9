"""FSDP2 strategy: ``torch.distributed.fsdp.fully_shard`` over ``devices x num_nodes`` ranks.

The controller (this process) holds :class:`FSDP2Strategy`; the ranks are :class:`FSDP2Worker`
objects, Ray actors when there is more than one rank, or one in-process worker otherwise (no
Ray, so breakpoints work). The controller splits each batch across the data-parallel ranks,
balanced by token count, with the same number of micro-batches on every rank (FSDP's collectives
must match); a rank short of rows runs a zero-weight padding micro-batch.

Gradients are summed across ranks, not averaged: ``policy_step`` normalises by the global token
or row count in ``micro_batch.meta``, so a 2-rank step equals a 1-rank step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rltrainer.controller.worker import Worker
from rltrainer.controller.worker_group import InProcessWorkerGroup, RayWorkerGroup, WorkerGroup, ensure_ray
from rltrainer.data.batch import RolloutBatch
from rltrainer.rollout.remote import RemoteEngine
from rltrainer.strategies.strategy import (STRATEGIES, Strategy, normalize_optimizers, run_compute,
                                          run_train_step)
from rltrainer.strategies.weights import (DEFAULT_BUCKET_BYTES, PackedBucket, ParamVersions, SharedBuffers,
                                          pack_bucket, plan_buckets, unpack_bucket)

if TYPE_CHECKING:
    from rltrainer.module import RLModule
    from rltrainer.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "split")


class FSDP2Worker(Worker):
    """One FSDP2 training rank (and, colocated, one rollout engine replica)."""

    def __init__(self, rank: int, world_size: int, threads: int | None = None, device: str = "auto",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(rank, world_size, threads=threads, device=device)
        self.bucket_bytes = bucket_bytes
        self.versions = ParamVersions()
        self.module: RLModule | None = None
        self.models: dict[str, torch.nn.Module] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self._plan: list[list[str]] = []
        self._plan_dtype: torch.dtype | None = None
        self._plan_marks_synced = False
        self.options: dict[str, Any] = {}
        self.shared: SharedBuffers | None = None

    # -- setup -----------------------------------------------------------------------------------
    def setup(self, module: RLModule, options: dict[str, Any], seed: int) -> None:
        """``configure_model`` with the same seed on every rank, shard every model, then
        ``configure_optimizers`` over the sharded (DTensor) parameters."""
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(seed)
        module.configure_model()
        if getattr(module, "policy", None) is None:
            raise RuntimeError(f"{type(module).__name__}.configure_model() must set self.policy")
        self.options = options
        precision = options["precision"]
        if precision == "bf16-true":
            module.to(torch.bfloat16)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        trainable = module.trainable_models()
        self.models = {name: child for name, child in module.named_children() if any(True for _ in child.parameters())}
        for name, model in self.models.items():
            if options["activation_checkpointing"] and name in trainable:
                enable_activation_checkpointing(name, model)
            model.to(self.device)
            shard_model(model, mesh, precision, options["cpu_offload"], options["reshard_after_forward"])
        self.module = module
        self.optimizers, self.schedulers = normalize_optimizers(module.configure_optimizers())

    def model_config(self) -> Any:
        return self.module.policy.config

    def weight_names(self) -> list[str]:
        return [n for n, _ in self.module.policy.named_parameters()]

    def use_shared_memory(self, directory: str, tag: str) -> None:
        """Gather weights through shared memory (every rank on this node, CPU tensors)."""
        self.shared = SharedBuffers(directory, tag, self.rank)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        self.engine_teardown()
        self.destroy_distributed()

    # -- compute ---------------------------------------------------------------------------------
    def compute(self, micro_batches: list[RolloutBatch], stage: str) -> dict[str, torch.Tensor]:
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        return run_compute(self.module, micro_batches, stage, list(self.models.values()), contextlib.nullcontext())

    def train_step(self, micro_batches: list[RolloutBatch]) -> dict[str, float]:
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        models = list(self.module.trainable_models().values())
        metrics, stepped = run_train_step(self.module, micro_batches, models, self.optimizers, self.schedulers,
                                          self.options["gradient_clip_val"],
                                          contextlib.nullcontext)
        self.versions.bump(stepped)
        return metrics

    # -- weights -----------------------------------------------------------------------------------
    def plan_export(self, dtype: torch.dtype | None, only_changed: bool) -> tuple[int, int]:
        """Plan the buckets of the next export; returns ``(buckets, skipped tensors)``."""
        params = dict(self.module.policy.named_parameters())
        names = self.versions.changed(params) if only_changed else list(params)
        itemsize = {n: (torch.empty((), dtype=dtype).element_size() if dtype else params[n].element_size()) for n in names}
        self._plan = plan_buckets([(n, params[n].numel() * itemsize[n]) for n in names], self.bucket_bytes)
        self._plan_dtype, self._plan_marks_synced = dtype, only_changed
        return len(self._plan), len(params) - len(names)

    def export_bucket(self, index: int) -> PackedBucket | None:
        """Gather bucket ``index`` (a collective: every rank calls it); rank 0 returns it packed."""
        tensors = self._gather(self._plan[index], self._plan_dtype, index)
        packed = pack_bucket(tensors) if self.rank == 0 else None
        if index == len(self._plan) - 1:
            self._end_of_sync()
        return packed

    def finish_export(self) -> None:
        if self._plan_marks_synced:
            self.versions.mark_synced(n for bucket in self._plan for n in bucket)
        self._plan = []

    def forget_synced(self) -> None:
        self.versions.forget_synced()

    def sync_local_engine(self, dtype: torch.dtype | None) -> dict[str, float]:
        """Colocated sync: gather the changed weights bucket by bucket into this rank's engine."""
        engine = self._require_engine()
        buckets, skipped = self.plan_export(dtype, only_changed=True)
        count = nbytes = 0
        for index, names in enumerate(self._plan):
            stats = engine.update_weights(self._gather(names, dtype, index))
            count += stats.get("tensors", 0)
            nbytes += stats.get("bytes", 0)
        self._end_of_sync()
        self.finish_export()
        return {"tensors": count, "bytes": nbytes, "skipped": skipped, "buckets": buckets}

    def _gather(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (bucket ``index``): through shared memory on one CPU node,
        else one async all-gather per DTensor with the whole bucket in flight."""
        from torch.distributed.tensor import DTensor

        params = {n: p.detach() for n, p in self.module.policy.named_parameters()}
        if self.world_size == 1 or not any(isinstance(params[n], DTensor) for n in names):
            return [(n, _local(params[n], dtype)) for n in names]
        if self.shared is not None:
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
        """Each rank writes its rows of each tensor into the node's shared buffer; after a
        barrier every rank reads the full tensors (views, valid until bucket ``index + 2``)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        layout, offset = [], 0
        for name in names:
            param = params[name]
            out_dtype = dtype or param.dtype
            nbytes = param.numel() * torch.empty((), dtype=out_dtype).element_size()
            layout.append((name, param, out_dtype, offset, nbytes))
            offset += -(-nbytes // 64) * 64
        buffer = self.shared.get(index, offset)
        out = []
        for name, param, out_dtype, start, nbytes in layout:
            full = buffer[start:start + nbytes].view(out_dtype).view(param.shape)
            if isinstance(param, DTensor):
                local = param.to_local()
                first = self.rank * -(-param.shape[0] // self.world_size)
                full[first:first + local.shape[0]].copy_(local)
            elif self.rank == 0:
                full.copy_(param)
            out.append((name, full))
        dist.barrier()
        return out

    def _end_of_sync(self) -> None:
        """Readers of the last bucket finish before the next sync writes the same buffer."""
        if self.shared is not None and self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

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

    def _owner(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        first = optimizer.param_groups[0]["params"][0]
        for model in self.module.trainable_models().values():
            if any(p is first for p in model.parameters()):
                return model
        raise RuntimeError("An optimizer holds parameters of no trainable model (trainable_models())")


def enable_activation_checkpointing(name: str, model: torch.nn.Module) -> None:
    """transformers' non-reentrant activation checkpointing (renamed in transformers 5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(f"activation_checkpointing needs a transformers model; {name} is {type(model).__name__}")


def _local(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.to(dtype) if dtype else local


def _all_gather(out: torch.Tensor, local: torch.Tensor) -> Any:
    """Async all-gather of equal shards into one tensor (``all_gather_single`` where torch has it)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, local, async_op=True)


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
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    for sub in model.modules():
        if type(sub).__name__ in block_names:
            fully_shard(sub, **kwargs)
    fully_shard(model, **kwargs)
    if any(p.requires_grad for p in model.parameters()):
        # policy_step normalises by global counts: sum gradients across ranks instead of averaging.
        # The setting is per FSDP unit, so set it on every sharded block and the root.
        for sub in model.modules():
            if hasattr(sub, "set_gradient_divide_factor"):
                if hasattr(sub, "set_force_sum_reduction_for_comms"):
                    sub.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
                sub.set_gradient_divide_factor(1.0)


@STRATEGIES.register("fsdp2", description="FSDP2 (fully_shard) over devices x num_nodes ranks")
class FSDP2Strategy(Strategy):
    """Fully sharded data parallel training (FSDP2) on ``devices x num_nodes`` ranks.

    Args:
        devices: ranks per node (``"auto"``: the GPUs of this machine, or 1 without GPUs).
        num_nodes: nodes of the Ray cluster to use.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU
            (``CPUOffloadPolicy``).
        activation_checkpointing: recompute each block's activations in backward (transformers'
            gradient checkpointing, non-reentrant).
        reshard_after_forward: free gathered parameters after each block's forward.
        rollout_placement: ``"colocated"`` (an engine replica in every training process: the
            hybrid engine) or ``"split"`` (``rollout_replicas`` engine processes of their own, in
            their own Ray placement group; weights go to them bucket by bucket).
        rollout_replicas: engine processes for ``"split"``.
        bucket_bytes: weight-sync bucket size; the extra memory of a sync is about one bucket.
        cpus_per_worker / gpus_per_worker: Ray resources per process (GPUs: 1 if the cluster
            has GPUs, else 0, by default).
        threads_per_worker: ``torch.set_num_threads`` in each Ray worker (default: its CPUs).
        ray_init_kwargs: passed to ``ray.init`` if this strategy starts Ray.
        shared_memory: gather weights for a sync through ``/dev/shm`` instead of gloo (``None``:
            whenever all ranks are CPU processes on one node; GPUs use NCCL all-gathers).
        **kwargs: micro-batching, clipping and precision, see :class:`Strategy`.
    """

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, cpu_offload: bool = False,
                 activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                 rollout_placement: str = "colocated", rollout_replicas: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, cpus_per_worker: float = 1.0,
                 gpus_per_worker: float | None = None, threads_per_worker: int | None = None,
                 ray_init_kwargs: dict[str, Any] | None = None, shared_memory: bool | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if devices == "auto":
            devices = max(torch.cuda.device_count(), 1)
        if not isinstance(devices, int) or devices < 1 or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"fsdp2 needs devices >= 1 and num_nodes >= 1 (ints), got devices={devices!r}, "
                             f"num_nodes={num_nodes!r}")
        if rollout_placement not in PLACEMENTS:
            raise ValueError(f"rollout_placement={rollout_placement!r}; choose from {', '.join(PLACEMENTS)}")
        if rollout_replicas < 1:
            raise ValueError(f"rollout_replicas must be >= 1, got {rollout_replicas}")
        self.world_size_ = devices * num_nodes
        self.options = {"precision": self.precision, "cpu_offload": cpu_offload,
                        "activation_checkpointing": activation_checkpointing,
                        "reshard_after_forward": reshard_after_forward,
                        "gradient_clip_val": self.gradient_clip_val}
        self.rollout_placement, self.rollout_replicas = rollout_placement, rollout_replicas
        self.bucket_bytes = bucket_bytes
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.threads_per_worker = threads_per_worker or max(1, int(cpus_per_worker))
        self.ray_init_kwargs = ray_init_kwargs
        self.shared_memory = shared_memory
        self.group: WorkerGroup | None = None
        self.rollout_group: WorkerGroup | None = None
        self.remote_engine: RemoteEngine | None = None
        self._started_ray = False
        self._config: Any = None
        self._weight_names: list[str] = []

    @property
    def world_size(self) -> int:
        return self.world_size_

    # -- setup -----------------------------------------------------------------------------------
    def _ray_group(self, worker_cls: type, size: int, name: str, **init_kwargs: Any) -> RayWorkerGroup:
        import ray

        self._started_ray = ensure_ray(self.ray_init_kwargs) or self._started_ray
        gpus = self.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        return RayWorkerGroup(worker_cls, size, name=name, cpus_per_worker=self.cpus_per_worker,
                              gpus_per_worker=gpus, threads=self.threads_per_worker, **init_kwargs)

    def setup(self, module: RLModule, seed: int) -> None:
        if self.world_size == 1:
            self.group = InProcessWorkerGroup(FSDP2Worker, name="actor", bucket_bytes=self.bucket_bytes)
            payload: Any = module
        else:
            import ray

            self.group = self._ray_group(FSDP2Worker, self.world_size, "actor", bucket_bytes=self.bucket_bytes)
            ship_user_code(module)
            payload = ray.put(module)  # serialised once for all ranks
        addr, port = self.group.execute_rank_zero("master_address")
        self.group.execute_all("init_distributed", addr, port)
        self.group.execute_all("setup", payload, self.options, seed)
        if self.world_size > 1 and self._shared_memory_ok():
            self.group.execute_all("use_shared_memory", "/dev/shm", uuid.uuid4().hex[:12])
        self._config = self.group.execute_rank_zero("model_config")
        self._weight_names = self.group.execute_rank_zero("weight_names")

    def _shared_memory_ok(self) -> bool:
        """Weights gather through /dev/shm when every rank is a CPU process on one node."""
        if self.shared_memory is False or not os.path.isdir("/dev/shm"):
            return False
        same_node = len(set(self.group.execute_all("node_ip"))) == 1
        on_cpu = set(self.group.execute_all("device_type")) == {"cpu"}
        if self.shared_memory and not (same_node and on_cpu):
            raise ValueError("shared_memory=True needs every rank on one node and on CPU")
        return same_node and on_cpu

    def connect_engine(self, engine: RolloutEngine, tokenizer: Any) -> RolloutEngine:
        """Colocated: one replica in every training process. Split: ``rollout_replicas`` Ray
        processes of their own (in their own placement group)."""
        group = self._require_group()
        if self.rollout_placement == "split":
            group = self.rollout_group = self._ray_group(Worker, self.rollout_replicas, "rollout")
        group.execute_all("setup_engine", engine, self._config, tokenizer)
        self.group.execute_all("forget_synced")
        self.remote_engine = RemoteEngine(group, tokenizer, getattr(engine, "dtype", None), self.rollout_placement)
        return self.remote_engine

    def _require_group(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("FSDP2Strategy is not set up (Trainer.fit calls setup) or was torn down")
        return self.group

    # -- compute ---------------------------------------------------------------------------------
    def compute(self, batch: RolloutBatch, stage: str) -> RolloutBatch:
        parts, rows = partition_for_ranks(batch, self.world_size, self.micro_batch_size, self.max_tokens_per_micro_batch)
        outs = self._require_group().dispatch("compute", [((p, stage), {}) for p in parts])
        merged: dict[str, torch.Tensor] = {}
        for key in outs[0]:
            first = outs[0][key]
            full = torch.empty((len(batch), *first.shape[1:]), dtype=first.dtype)
            for out, idx in zip(outs, rows):
                full[idx] = out[key][: len(idx)]
            merged[key] = full
        return RolloutBatch(merged, batch_size=len(batch))

    def train_step(self, mini_batch: RolloutBatch) -> dict[str, float]:
        parts, _ = partition_for_ranks(mini_batch, self.world_size, self.micro_batch_size,
                                       self.max_tokens_per_micro_batch)
        outs = self._require_group().dispatch("train_step", [((p,), {}) for p in parts])
        metrics = {k: sum(o.get(k, 0.0) for o in outs) for k in outs[0]}  # global-normalised parts add up
        metrics["actor/grad_norm"] = outs[0]["actor/grad_norm"]  # already the global norm on every rank
        metrics["actor/lr"] = outs[0]["actor/lr"]
        return metrics

    # -- weights -----------------------------------------------------------------------------------
    def export_weights(self, dtype: torch.dtype | None = None,
                       only_changed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather the policy to this process bucket by bucket (rank 0 packs, Ray carries)."""
        group = self._require_group()
        buckets, _ = group.execute_all("plan_export", dtype, only_changed)[0]
        for index in range(buckets):
            yield from unpack_bucket(group.execute_all("export_bucket", index)[0])
        group.execute_all("finish_export")

    def weight_names(self) -> list[str]:
        return list(self._weight_names)

    def sync_weights(self, engine: RolloutEngine) -> dict[str, float]:
        start = time.perf_counter()
        dtype = getattr(engine, "dtype", None)
        if engine is not self.remote_engine:  # an engine in this process: pull through export_weights
            stats = super().sync_weights(engine)
        elif self.rollout_placement == "colocated":
            stats = self._require_group().execute_all("sync_local_engine", dtype)[0]
        else:
            stats = self._push_buckets(dtype)
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _push_buckets(self, dtype: torch.dtype | None) -> dict[str, float]:
        """Split placement: rank 0 packs each gathered bucket, Ray moves it to every replica; at
        most two buckets are in flight, so memory stays about two buckets."""
        group, rollout = self._require_group(), self.rollout_group
        buckets, skipped = group.execute_all("plan_export", dtype, True)[0]
        in_flight: list[tuple[list[Any], list[Any]]] = []
        count = nbytes = 0

        def drain(item: tuple[list[Any], list[Any]]) -> None:
            nonlocal count, nbytes
            group.get(item[0], "export_bucket")
            stats = rollout.get(item[1], "load_bucket")[0]
            count, nbytes = count + stats["tensors"], nbytes + stats["bytes"]

        for index in range(buckets):
            exports = group.execute_all_async("export_bucket", index)
            packed = exports[0] if isinstance(group, RayWorkerGroup) else group.get(exports[:1], "export_bucket")[0]
            in_flight.append((exports, rollout.execute_all_async("load_bucket", packed)))
            if len(in_flight) == 2:
                drain(in_flight.pop(0))
        for item in in_flight:
            drain(item)
        group.execute_all("finish_export")
        return {"tensors": count, "bytes": nbytes, "skipped": skipped, "buckets": buckets}

    # -- state -------------------------------------------------------------------------------------
    def model_config(self) -> Any:
        return self._config

    def state_dict(self) -> dict[str, Any]:
        return self._require_group().execute_all("state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        group = self._require_group()
        if isinstance(group, RayWorkerGroup):
            import ray

            state = ray.put(state)
        group.execute_all("load_state_dict", state)

    def teardown(self) -> None:
        for group in (self.rollout_group, self.group):
            if group is None:
                continue
            if isinstance(group, InProcessWorkerGroup):
                group.worker.close()
            group.shutdown()
        self.group = self.rollout_group = self.remote_engine = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False


def ship_user_code(module: Any) -> None:
    """Pickle the code of the module's class by value when it lives outside installed packages
    (a script's or a test's local module that the worker processes could not import)."""
    import sys

    from ray import cloudpickle

    for cls in type(module).__mro__:
        name = cls.__module__
        source = sys.modules.get(name)
        path = str(getattr(source, "__file__", "") or "")
        if source is None or name == "__main__" or name.split(".")[0] in ("rltrainer", "torch", "builtins"):
            continue
        if "site-packages" in path or "dist-packages" in path or not path:
            continue
        cloudpickle.register_pickle_by_value(source)


def partition_for_ranks(batch: RolloutBatch, world_size: int, micro_batch_size: int,
                        max_tokens: int | None) -> tuple[list[list[RolloutBatch]], list[torch.Tensor]]:
    """Rank ``r``'s micro-batches and the batch rows they hold (real rows first, in order).

    Rows go to ranks balanced by token count (longest first, to the least loaded rank with room;
    at most ``ceil(N / world_size)`` rows each). Every rank gets the same number of micro-batches;
    a rank with fewer pads with one-row micro-batches whose ``response_mask`` is all zero (they add
    nothing to a masked loss, and their outputs are dropped).
    """
    n = len(batch)
    tokens = batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else [1] * n
    cap = -(-n // world_size)
    loads, assigned = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: -tokens[i]):
        rank = min((r for r in range(world_size) if len(assigned[r]) < cap), key=lambda r: (loads[r], r))
        assigned[rank].append(i)
        loads[rank] += tokens[i]
    rows = [torch.tensor(sorted(a), dtype=torch.long) for a in assigned]
    parts = []
    for idx in rows:
        sub = batch[idx] if len(idx) else None
        if sub is None:
            parts.append([])
        elif max_tokens:
            parts.append(sub.split_by_tokens(max_tokens))
        else:
            parts.append(sub.split(micro_batch_size))
    count = max(len(p) for p in parts)
    if any(len(p) < count for p in parts):
        pad = batch[[0]].copy()
        if "response_mask" in pad:
            pad["response_mask"] = torch.zeros_like(pad["response_mask"])
        pad.meta["padding"] = True
        for p in parts:
            p.extend(pad for _ in range(count - len(p)))
    return parts, rows


STRATEGIES.register_preset("fsdp2_offload", "fsdp2", description="fsdp2 with CPU offload", cpu_offload=True)
STRATEGIES.register_preset("fsdp2_checkpointing", "fsdp2", description="fsdp2 with activation checkpointing",
                           activation_checkpointing=True)
STRATEGIES.register_preset("fsdp2_split", "fsdp2", description="fsdp2 with rollout in its own Ray processes",
                           rollout_placement="split")
