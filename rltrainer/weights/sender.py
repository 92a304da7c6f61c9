"""A training rank's side of weight sync: plan the changed tensors into buckets, gather each
bucket (a collective over the training ranks), and hand its bytes to a transport.

:class:`WeightSender` is composed into a training rank (``TrainingWorker``), which provides the
:class:`WeightSource` methods; the controller's transports
(:mod:`rltrainer.weights.transports`) call it through the rank's typed remote methods
(``TrainingWorker.plan_weights``, ``export_bucket``, ``write_slot``...: the table there).
Every rank runs every call (the gathers are collectives); only rank 0 sends.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from rltrainer.weights.group import WeightGroup
from rltrainer.weights.shm import SharedSlots
from rltrainer.weights.versions import ParamVersions, mark_loaded
from rltrainer.weights.wire import Bucket, Entry, bucket_entries, bucket_nbytes, flatten_bucket, flatten_into, \
    itemsize, plan_buckets

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class WeightSource(Protocol):
    """What a training rank provides (see ``TrainingWorker``)."""

    rank: int
    device: torch.device
    engine: Any  # colocated: this rank's engine replica (None if it holds none)

    def weight_specs(self) -> Specs:
        """The policy's HF names, in export order, with their full shapes and dtypes."""

    def gather_weights(self, names: list[str], dtype: torch.dtype | None, index: int) -> list[tuple[str, torch.Tensor]]:
        """Full tensors of ``names`` (bucket ``index``; a collective: every rank calls it)."""

    def gather_weights_into(self, names: list[str], dtype: torch.dtype | None, index: int, entries: list[Entry],
                            out: torch.Tensor) -> bool:
        """Write bucket ``index`` in wire layout straight into ``out``, a shared-memory slot every
        rank has mapped (a collective); False if this layout cannot (then :meth:`gather_weights`)."""

    def end_of_sync(self) -> None:
        """After the last bucket of a sync (e.g. a barrier before buffers are reused)."""


class WeightSender:
    """Args:
        source: the training rank.
        bucket_bytes: the bucket bound (a tensor larger than it travels alone).
    """

    def __init__(self, source: WeightSource, bucket_bytes: int) -> None:
        self.source, self.bucket_bytes = source, bucket_bytes
        self.versions = ParamVersions()
        self._plan: list[list[str]] = []
        self._dtype: torch.dtype | None = None
        self._marks_synced = False
        self._group: WeightGroup | None = None
        self._slots: SharedSlots | None = None
        self._slots_everywhere = False  # every training rank mapped the slots (one node)

    # -- planning ------------------------------------------------------------------------------
    def plan(self, dtype: torch.dtype | None, only_changed: bool) -> tuple[int, int]:
        """Plan the next sync's buckets; returns ``(buckets, skipped tensors)``. With
        ``only_changed``, only names whose version moved, marked synced by :meth:`finish`."""
        specs = self.source.weight_specs()
        names = self.versions.changed(specs) if only_changed else list(specs)

        def nbytes(name: str) -> int:
            shape, own_dtype = specs[name]
            return math.prod(shape) * itemsize(dtype or own_dtype)

        self._plan = plan_buckets([(n, nbytes(n)) for n in names], self.bucket_bytes, self.versions.groups)
        self._dtype, self._marks_synced = dtype, only_changed
        return len(self._plan), len(specs) - len(names)

    def entries(self) -> list[list[Entry]]:
        """Every planned bucket's wire entries (small: for receivers to size their buffers)."""
        return [self._entries(i) for i in range(len(self._plan))]

    def _entries(self, index: int) -> list[Entry]:
        specs = self.source.weight_specs()
        return bucket_entries((n, specs[n][0], self._dtype or specs[n][1]) for n in self._plan[index])

    def finish(self) -> None:
        """The sync's buckets are all handed off: mark their names synced."""
        if self._marks_synced:
            self.versions.mark_synced(n for bucket in self._plan for n in bucket)
        self._plan = []

    def forget_synced(self) -> None:
        self.versions.forget_synced()

    def _gather(self, index: int) -> list[tuple[str, torch.Tensor]]:
        tensors = self.source.gather_weights(self._plan[index], self._dtype, index)
        if index == len(self._plan) - 1:
            self.source.end_of_sync()
        return tensors

    # -- in-process and object-store: rank 0 returns each bucket --------------------------------------
    def export(self, index: int) -> Bucket | None:
        """Gather bucket ``index``; rank 0 returns it as a :class:`Bucket` (other ranks ``None``)."""
        tensors = dict(self._gather(index))
        if self.source.rank != 0:
            return None
        entries = self._entries(index)
        return Bucket(entries, flatten_bucket(tensors, entries, "cpu").numpy())

    # -- colocated: every rank loads its own engine replica ------------------------------------------------
    def load_local(self, dtype: torch.dtype | None, version: int) -> dict[str, float]:
        """Gather the changed weights bucket by bucket into this rank's engine replica, then set its
        ``weight_version``."""
        engine = self.source.engine
        if engine is None:
            raise RuntimeError(f"Training rank {self.source.rank} holds no rollout engine (colocated sync before "
                               "connect_engine)")
        buckets, skipped = self.plan(dtype, only_changed=True)
        count = nbytes = 0
        if buckets:
            engine.start_weight_update()
        for index in range(buckets):
            stats = engine.update_weights(self._gather(index))
            count, nbytes = count + stats.get("tensors", 0), nbytes + stats.get("bytes", 0)
        if buckets:
            engine.finish_weight_update()
        self.finish()
        mark_loaded(engine, version)
        return {"tensors": count, "bytes": nbytes, "skipped": skipped, "buckets": buckets}

    # -- collective broadcast ----------------------------------------------------------------------------
    def join_group(self, address: str, port: int, world_size: int, group_name: str, backend: str,
                   timeout_s: float) -> None:
        """Rank 0 hosts the weight-broadcast group's store and joins it as rank 0."""
        self.leave_group()
        self._group = WeightGroup(address, port, 0, world_size, group_name, backend, timeout_s)

    def broadcast(self, index: int) -> None:
        """Gather bucket ``index``; rank 0 broadcasts its bytes."""
        tensors = dict(self._gather(index))
        if self.source.rank == 0:
            if self._group is None:
                raise RuntimeError("broadcast before join_group (the transport was not connected)")
            self._group.broadcast(flatten_bucket(tensors, self._entries(index), self.source.device))

    def leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    # -- shared memory ----------------------------------------------------------------------------------
    def slot_bytes(self, dtype: torch.dtype | None) -> int:
        """The size a shared-memory slot needs: any planned bucket fits (``bucket_bytes``, or the
        largest single tensor if that is larger)."""
        specs = self.source.weight_specs()
        largest = max((math.prod(s) * itemsize(dtype or d) for s, d in specs.values()), default=0)
        return max(self.bucket_bytes, largest, 1)

    def create_slots(self, directory: str, tag: str, nbytes: int) -> list[str]:
        """Rank 0: create and map the two slots; returns their paths for the others to open."""
        self.close_slots()
        self._slots = SharedSlots.create(directory, tag, nbytes)
        return self._slots.paths

    def share_slots(self, paths: list[str], nbytes: int, everywhere: bool) -> None:
        """Every rank: with ``everywhere`` (all training ranks on rank 0's node), open the slots, so
        a layout that can gathers straight into them."""
        if everywhere and self.source.rank != 0:
            self.close_slots()
            self._slots = SharedSlots.open(paths, nbytes)
        self._slots_everywhere = everywhere

    def unlink_slots(self) -> None:
        if self._slots is not None:
            self._slots.unlink()

    def write_slot(self, index: int) -> int:
        """Gather bucket ``index`` into slot ``index % 2`` in wire layout; returns its bytes (the
        rollout processes' load calls take rank 0's result as an argument, so they run after it)."""
        entries = self._entries(index)
        nbytes = bucket_nbytes(entries)
        out = self._slots.slot(index, nbytes) if self._slots is not None else None
        direct = self._slots_everywhere and self.source.gather_weights_into(self._plan[index], self._dtype, index,
                                                                             entries, out)
        if direct:
            if index == len(self._plan) - 1:
                self.source.end_of_sync()
        else:
            tensors = self._gather(index)
            if self.source.rank == 0:
                if out is None:
                    raise RuntimeError("write_slot before create_slots (the transport was not connected)")
                flatten_into(out, dict(tensors), entries)
        return nbytes

    def close_slots(self) -> None:
        if self._slots is not None:
            self._slots.unlink()
            self._slots.close()
            self._slots = None
        self._slots_everywhere = False

    def close(self) -> None:
        self.leave_group()
        self.close_slots()
