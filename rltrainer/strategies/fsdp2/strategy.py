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
        rollout_placement: ``"colocated"`` (an engine replica in every training process: the
            hybrid engine) or ``"split"`` (``rollout_replicas`` engine processes of their own, in
            their own Ray placement group; weights go to them bucket by bucket, see
            ``weight_transport``, received beside the request a replica is generating and applied
            between two requests: each replica holds one extra copy of the weights that changed
            since the last sync, on its device, while a sync arrives; see
            :mod:`rltrainer.weights.staging`).
        rollout_replicas: engine processes for ``"split"``.
        weight_transport: how ``"split"`` moves weights to the replicas
            (:mod:`rltrainer.weights.transports`). ``"broadcast"``: trainer rank 0 and every
            replica's receiving processes (SGLang: its ``tp_size`` schedulers) form a process group
            of their own, NCCL when all are on GPUs, else gloo, and each bucket is one broadcast
            straight into the engines' devices. ``"shared_memory"``: every replica on trainer rank
            0's node maps two ``/dev/shm`` slots, rank 0 writes each bucket into one, the replicas
            load views of it. ``"object_store"``: rank 0 returns each bucket and Ray's object store
            carries it (any node; a copy through host memory per replica). ``"auto"`` (default):
            broadcast when everything is on GPUs, else shared memory on one node, else the object
            store.
        weight_sync_timeout_s: ``"broadcast"``: how long the group's members wait for each other
            to join, and for each bucket's broadcast (default 600 s). Raise it for slow links or
            very large buckets; an engine that receives on its own (SGLang) starts receiving a sync
            only once its running request has finished, so a request may need to fit in it too.
        weight_sync_delta: ``"split"`` only: send each bucket as the words that changed since the
            replicas' copy (int8 steps and 16-bit offsets) when that is at most a tenth of its bytes,
            else in full (backing off for a few syncs), with the checksum of every tensor a delta
            updated verified after each sync (a mismatch is sent again in full); ``True`` or
            :class:`~rltrainer.weights.delta.DeltaSync` ``(max_share=..., checksum_every=...,
            copies=...)``. Costs one engine-dtype copy of the weights on trainer rank 0, and one per
            rollout process for engines that cannot lend their tensors (vLLM), in host memory
            unless ``copies="device"``. See :mod:`rltrainer.weights.delta`.
        bucket_bytes: weight-sync bucket size; the extra memory of a sync is about one bucket.
        cpus_per_worker / gpus_per_worker: Ray resources per process (GPUs: 1 if the cluster
            has GPUs, else 0, by default).
        threads_per_worker: ``torch.set_num_threads`` in each Ray worker (default: its CPUs).
        ray_init_kwargs: passed to ``ray.init`` if this strategy starts Ray.
        shared_memory: gather weights for a sync through ``/dev/shm`` instead of gloo (``None``:
            whenever all ranks are CPU processes on one node; GPUs use NCCL all-gathers).
        **kwargs: micro-batching, clipping and precision, see :class:`Strategy`.
    """

    name = "fsdp2"
    worker_cls = FSDP2Worker
    trains_lora = True

    def __init__(self, devices: int | str = 1, num_nodes: int = 1, cpu_offload: bool = False,
                 activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                 shared_memory: bool | None = None, **kwargs: Any) -> None:
        super().__init__(devices=devices, num_nodes=num_nodes, **kwargs)
        self.options.update(cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                            reshard_after_forward=reshard_after_forward)
        self.shared_memory = shared_memory

    def _after_setup(self) -> None:
        if self.world_size > 1 and self._shared_memory_ok():
            self._require_group().execute_all("use_shared_memory", "/dev/shm", uuid.uuid4().hex[:12])

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
STRATEGIES.register_preset("fsdp2_split", "fsdp2", description="fsdp2 with rollout in its own Ray processes",
                           rollout_placement="split")
