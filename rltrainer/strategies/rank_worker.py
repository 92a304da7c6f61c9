"""The rank side of a multi-process strategy: :class:`TrainingWorker`, one per training process.

The controller's :class:`~rltrainer.strategies.dispatch.WorkerGroupStrategy` calls its methods by
name on every rank (``setup``, ``compute``, ``train_step``...); the weight-sending protocol's are
typed remote methods (``@remote``, :mod:`rltrainer.controller.methods`: ``plan_weights``,
``export_bucket``, ``broadcast_bucket``, ``write_slot``...). A strategy's rank
class (``FSDP2Worker``, ``MegatronWorker``) subclasses it with the model layout: how ``setup``
places the models, and the weight export's ``weight_specs`` / ``gather_weights`` (optionally
``gather_weights_into``), which a :class:`~rltrainer.weights.sender.WeightSender` drives. A colocated
rollout engine replica lives in the same process (the :class:`~rltrainer.rollout.worker.Worker`
base class holds it).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rltrainer.checkpoints import CheckpointError, check_files, digest_files, safe_load, save_file
from rltrainer.controller.methods import ALL, RANK_ZERO, remote
from rltrainer.data.batch import RolloutBatch
from rltrainer.lora import LoraView
from rltrainer.rollout.worker import Stats, Worker
from rltrainer.strategies.strategy import (clip_gradients, load_local_training_state, local_training_state, run_compute,
                                          run_micro_batches, run_train_step)
from rltrainer.weights.delta import DeltaSync
from rltrainer.weights.sender import WeightSender
from rltrainer.weights.versions import ParamVersions
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES, Bucket, Encoding, Entry

if TYPE_CHECKING:
    from rltrainer.module import RLModule

#: a weight-sending method (the watchdog's stage ``<group>.send_weights``): on every rank (gathers
#: are collectives), or on rank 0 only
sends = remote(ALL, stage="send_weights")
sends_rank_zero = remote(RANK_ZERO, stage="send_weights")


class TrainingWorker(Worker):
    """A training rank (and, colocated, a rollout engine replica). It runs every call in one thread,
    in the order the controller sent them: the ranks' collectives must match."""

    concurrency_groups: ClassVar[dict[str, int]] = {}

    def __init__(self, rank: int, world_size: int, threads: int | None = None, device: str = "auto",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(rank, world_size, threads=threads, device=device)
        self.bucket_bytes = bucket_bytes
        self.sender = WeightSender(self, bucket_bytes)
        self.module: RLModule | None = None
        self.models: dict[str, torch.nn.Module] = {}  # every model of the module, as placed on this rank
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self.options: dict[str, Any] = {}
        self.view: Any = None  # a LoRA policy's rltrainer.lora.LoraView (what the export names)

    # -- what a subclass provides ------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The policy's HF names, in export order, with their full shapes and dtypes."""
        raise NotImplementedError

    def gather_weights(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (bucket ``index``; a collective: every rank calls it)."""
        raise NotImplementedError

    def gather_weights_into(self, names: list[str], dtype: torch.dtype | None, index: int, entries: list[Entry],
                            out: torch.Tensor) -> bool:
        """Write bucket ``index`` in wire layout (``entries``) straight into ``out``, a shared-memory
        slot every rank has mapped (a collective); False (the default) if this layout cannot, and
        then :meth:`gather_weights` runs and rank 0 copies."""
        return False

    def end_of_sync(self) -> None:
        """After the last bucket of a sync (e.g. a barrier before buffers are reused)."""

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float | None) -> float:
        """Reduce (if the layout needs it) and clip gradients; return the global norm."""
        return clip_gradients(params, max_norm)

    def run_micro_batches(self, hook: Any, micro_batches: list[RolloutBatch], backward: bool) -> list[Any]:
        """How the hook runs over this rank's micro-batches (see :func:`run_micro_batches`)."""
        return run_micro_batches(hook, micro_batches, backward)

    @property
    def versions(self) -> ParamVersions:
        """The policy's per-parameter versions (what the next sync sends)."""
        return self.sender.versions

    def mark_stepped(self, stepped: list[str]) -> None:
        """The optimizer step changed these policy parameters: bump their HF names' versions
        (a LoRA policy: the outputs of its view they make up)."""
        self.versions.bump(self.view.outputs_of(stepped) if self.view is not None else stepped)

    @remote
    def set_weight_view(self, mode: str | None) -> None:
        """Export the LoRA policy as ``mode`` (:class:`rltrainer.lora.LoraView`; ``None``: as it is)."""
        self.view = LoraView(self.module.policy, mode) if mode is not None else None

    # -- what a layout's rank provides, called by the controller ---------------------------------------
    @remote
    def setup(self, module: RLModule, options: dict[str, Any], seed: int) -> None:
        """Build the module's models on this rank, place them, build the optimizers (a layout's own)."""
        raise NotImplementedError

    @remote
    def state_dict(self) -> dict[str, Any] | None:
        """Everything needed to resume (a layout's own; rank 0's, or every rank's share)."""
        raise NotImplementedError

    @remote
    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- compute (every rank, on its share of the batch) ---------------------------------------------
    @remote
    def compute(self, micro_batches: list[RolloutBatch], stage: str) -> dict[str, torch.Tensor]:
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        return run_compute(self.module, micro_batches, stage, list(self.models.values()), contextlib.nullcontext(),
                           runner=self.run_micro_batches)

    @remote
    def train_step(self, micro_batches: list[RolloutBatch]) -> dict[str, float]:
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        models = list(self.module.trainable_models().values())
        metrics, stepped = run_train_step(self.module, micro_batches, models, self.optimizers, self.schedulers,
                                          self.options["gradient_clip_val"], contextlib.nullcontext,
                                          clip_fn=self.clip_gradients, runner=self.run_micro_batches)
        self.mark_stepped(stepped)
        return metrics

    # -- checkpoints: each rank writes and reads its own part ----------------------------------------
    @remote
    def save_checkpoint(self, directory: str, async_save: bool = False) -> None:
        """This rank's models, optimizers and schedulers as ``directory/rank=<r>.pt``, written at once
        (a layout that reshards or saves in the background overrides it, see ``FSDP2Worker``)."""
        save_file(local_training_state(self.module, self.optimizers, self.schedulers), self._rank_file(directory),
                  f"rank {self.rank}'s models, optimizers and schedulers")

    @remote
    def wait_checkpoint(self) -> None:
        """Wait for this rank's background checkpoint write, if any."""

    def checkpoint_files(self, directory: str) -> list[str]:
        """The files this rank wrote into ``directory`` at its last :meth:`save_checkpoint` (names)."""
        return [self._rank_file(directory).name]

    @remote
    def checkpoint_digests(self, directory: str) -> dict[str, str]:
        """The sha256 of :meth:`checkpoint_files`, hashed here where they were written (after
        :meth:`wait_checkpoint`)."""
        return digest_files(Path(directory), self.checkpoint_files(directory))

    @remote
    def verify_checkpoint(self, directory: str, expected: dict[str, str]) -> list[str]:
        """What is wrong with this rank's share of the files (every ``world_size``-th name) against
        their recorded sha256 ``expected``: one line per missing or changed file."""
        names = sorted(expected)[self.rank::self.world_size]
        return check_files(Path(directory), {name: expected[name] for name in names})

    @remote
    def load_checkpoint(self, directory: str, optimizer: bool = True) -> None:
        """This rank's part of ``directory``; without ``optimizer`` its optimizers start afresh
        (:meth:`Strategy.load_checkpoint <rltrainer.strategies.strategy.Strategy.load_checkpoint>`)."""
        file = self._rank_file(directory)
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint in {directory} was saved with another number "
                                  f"of ranks or did not finish (this is rank {self.rank} of {self.world_size}).")
        state = safe_load(file, f"rank {self.rank}'s models, optimizers and schedulers")
        load_local_training_state(self.module, self.optimizers, self.schedulers, state, source=str(file),
                                  optimizer=optimizer)
        self.versions.forget_synced()

    def _rank_file(self, directory: str) -> Path:
        return Path(directory) / f"rank={self.rank}.pt"

    # -- shared --------------------------------------------------------------------------------------
    @remote(RANK_ZERO)
    def model_config(self) -> Any:
        return self.module.policy.config

    @remote(RANK_ZERO)
    def weight_names(self) -> list[str]:
        return list(self.weight_specs())

    def close(self) -> None:
        self.sender.close()
        self.engine_teardown()
        self.destroy_distributed()

    # -- weights: the sending side of rltrainer.weights' transports (its WeightSender) ----------------
    @sends
    def plan_weights(self, dtype: torch.dtype | None, only_changed: bool) -> tuple[int, int]:
        """Plan the next sync's buckets: ``(buckets, skipped tensors)``."""
        return self.sender.plan(dtype, only_changed)

    @sends_rank_zero
    def weight_entries(self) -> list[list[Entry]]:
        """Every planned bucket's wire entries."""
        return self.sender.entries()

    @sends
    def export_bucket(self, index: int) -> Bucket | None:
        """Gather bucket ``index``; rank 0 returns it."""
        return self.sender.export(index)

    @sends
    def finish_weights(self) -> None:
        """The sync's buckets are all handed off: their names count as synced."""
        self.sender.finish()

    @sends
    def load_local_weights(self, dtype: torch.dtype | None, version: int) -> Stats:
        """Colocated: load the changed weights into this rank's own engine replica as ``version``."""
        return self.sender.load_local(dtype, version)

    @sends_rank_zero
    def host_weight_group(self, address: str, port: int, world_size: int, group_name: str, backend: str,
                          timeout_s: float) -> None:
        """Host the broadcast group's store and join it as its rank 0."""
        self.sender.join_group(address, port, world_size, group_name, backend, timeout_s)

    @sends
    def configure_weight_sync(self, bucket_bytes: int, delta: DeltaSync | None) -> None:
        """A new engine's syncs (``Rollout(bucket_bytes=..., delta=...)``): buckets of at most
        ``bucket_bytes`` (a checkpoint's files too), delta sync on (``delta``) or off; the next sync
        sends every weight in full."""
        self.bucket_bytes = self.sender.bucket_bytes = bucket_bytes
        self.sender.configure_delta(delta)

    @sends
    def encode_bucket(self, index: int) -> Encoding | None:
        """Delta sync over a broadcast: gather and code bucket ``index``; rank 0 returns its encoding."""
        return self.sender.encode(index)

    @sends_rank_zero
    def base_buckets(self, entries: list[list[Entry]]) -> list[Bucket]:
        """Delta sync: buckets in full from the delta base (to repair a checksum mismatch)."""
        return self.sender.base_buckets(entries)

    @sends
    def broadcast_bucket(self, index: int) -> None:
        """Gather bucket ``index``; rank 0 broadcasts it."""
        self.sender.broadcast(index)

    @sends_rank_zero
    def leave_weight_group(self) -> None:
        self.sender.leave_group()

    @sends_rank_zero
    def weight_slot_bytes(self, dtype: torch.dtype | None) -> int:
        """The size a shared-memory slot needs."""
        return self.sender.slot_bytes(dtype)

    @sends_rank_zero
    def create_weight_slots(self, directory: str, tag: str, nbytes: int) -> list[str]:
        """Create and map the two shared-memory slots; their paths."""
        return self.sender.create_slots(directory, tag, nbytes)

    @sends
    def share_weight_slots(self, paths: list[str], nbytes: int, everywhere: bool) -> None:
        """With ``everywhere``, every rank maps the slots (a layout that can gathers straight into them)."""
        self.sender.share_slots(paths, nbytes, everywhere)

    @sends_rank_zero
    def unlink_weight_slots(self) -> None:
        self.sender.unlink_slots()

    @sends
    def write_slot(self, index: int) -> int | Encoding | None:
        """Gather bucket ``index`` into its slot; its bytes (delta sync: rank 0's encoding)."""
        return self.sender.write_slot(index)

    @sends
    def close_weight_slots(self) -> None:
        self.sender.close_slots()

    @remote
    def forget_synced(self) -> None:
        """The engines lost their weights: the next sync sends everything."""
        self.sender.forget_synced()

    @remote
    def set_weight_groups(self, groups: list[list[str]]) -> None:
        """A new engine: the names it takes together (``RolloutEngine.weight_groups``); the next
        sync sends everything."""
        self.versions.set_groups(groups)
        self.sender.forget_synced()
