"""The controller side of ``strategy="fsdp2"``: :class:`FSDP2Strategy` and its presets."""

from __future__ import annotations

import os
import uuid
from typing import Any

from rltrainer.strategies.dispatch import WorkerGroupStrategy
from rltrainer.strategies.fsdp2.worker import FSDP2Worker
from rltrainer.strategies.strategy import STRATEGIES


@STRATEGIES.register("fsdp2", description="FSDP2 (fully_shard) over devices x num_nodes ranks")
class FSDP2Strategy(WorkerGroupStrategy):
    """Fully sharded data parallel training (FSDP2) on ``devices x num_nodes`` ranks.

    Args:
        devices: ranks per node (``"auto"``: the GPUs of this machine, or 1 without GPUs).
        num_nodes: nodes of the Ray cluster to use.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU
            (``CPUOffloadPolicy``).
        activation_checkpointing: recompute each block's activations in backward (transformers'
            gradient checkpointing, non-reentrant).
        reshard_after_forward: free gathered parameters after each block's forward.
        cpus_per_worker / gpus_per_worker: Ray resources per process (GPUs: 1 if the cluster
            has GPUs, else 0, by default).
        threads_per_worker: ``torch.set_num_threads`` in each Ray worker (default: its CPUs).
        ray_init_kwargs: passed to ``ray.init`` if this strategy starts Ray.
        shared_memory: gather weights for a sync through ``/dev/shm`` instead of gloo (``None``:
            whenever all ranks are CPU processes on one node; GPUs use NCCL all-gathers).
        micro_batch_size / max_tokens_per_micro_batch / gradient_clip_val / precision / padding_free:
            micro-batching, clipping and precision, see :class:`~rltrainer.strategies.strategy.Strategy`.

    Where the rollout engine runs (in these ranks, or in processes of its own) and how weights reach
    it is the :class:`~rltrainer.rollout.rollout.Rollout`'s: ``Trainer(strategy=FSDP2Strategy(...),
    rollout=Rollout("vllm", placement="split", replicas=2))``.
    """

    name = "fsdp2"
    worker_cls = FSDP2Worker
    trains_lora = True

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, cpu_offload: bool = False,
                 activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                 shared_memory: bool | None = None, cpus_per_worker: float = 1.0, gpus_per_worker: float | None = None,
                 threads_per_worker: int | None = None, ray_init_kwargs: dict[str, Any] | None = None,
                 micro_batch_size: int = 8, max_tokens_per_micro_batch: int | None = None,
                 gradient_clip_val: float | None = 1.0, precision: str = "32-true", padding_free: bool = False) -> None:
        super().__init__(devices, num_nodes, cpus_per_worker, gpus_per_worker, threads_per_worker, ray_init_kwargs,
                         micro_batch_size, max_tokens_per_micro_batch, gradient_clip_val, precision, padding_free)
        self.options.update(cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                            reshard_after_forward=reshard_after_forward)
        self.shared_memory = shared_memory

    def _after_setup(self) -> None:
        if self.world_size > 1 and self._shared_memory_ok():
            self.require_group().execute_all("use_shared_memory", "/dev/shm", uuid.uuid4().hex[:12])

    def _shared_memory_ok(self) -> bool:
        """Weights gather through /dev/shm when every rank is a CPU process on one node."""
        if self.shared_memory is False or not os.path.isdir("/dev/shm"):
            return False
        same_node = len(set(self.group.execute_all("node_ip"))) == 1
        on_cpu = set(self.group.execute_all("device_type")) == {"cpu"}
        if self.shared_memory and not (same_node and on_cpu):
            raise ValueError("shared_memory=True needs every rank on one node and on CPU")
        return same_node and on_cpu


STRATEGIES.register_preset("fsdp2_offload", "fsdp2", description="fsdp2 with CPU offload", cpu_offload=True)
STRATEGIES.register_preset("fsdp2_checkpointing", "fsdp2", description="fsdp2 with activation checkpointing",
                           activation_checkpointing=True)
