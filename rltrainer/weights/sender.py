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

from rltrainer.weights.delta import DeltaEncoder, DeltaSync
from rltrainer.weights.group import WeightGroup
from rltrainer.weights.shm import SharedSlots
from rltrainer.weights.versions import ParamVersions, mark_loaded
from rltrainer.weights.wire import Bucket, Encoding, Entry, bucket_entries, bucket_nbytes, flatten_bucket, \
    flatten_into, itemsize, plan_buckets

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
        self.delta: DeltaEncoder | None = None  # delta sync (rank 0 codes; every rank knows it is on)
        self._coding = False  # this sync's buckets are coded (delta sync on, a sync of the changed names)
        self._encoded: torch.Tensor | None = None  # the broadcast's coded bucket, between encode and broadcast

    def configure_delta(self, settings: DeltaSync | None) -> None:
        """Turn delta sync on (``settings``) or off; either way the next sync sends every name in full."""
        self.delta = DeltaEncoder(settings) if settings is not None else None
        self.versions.forget_synced()

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
        self._coding = self.delta is not None and only_changed
        if self._coding and self.source.rank == 0:
            self.delta.begin_sync(n for n in names if n not in self.versions.synced)
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
        if self.delta is not None:
            self.delta.forget()

    def _gather(self, index: int) -> list[tuple[str, torch.Tensor]]:
        tensors = self.source.gather_weights(self._plan[index], self._dtype, index)
        if index == len(self._plan) - 1:
            self.source.end_of_sync()
        return tensors

    # -- in-process and object-store: rank 0 returns each bucket --------------------------------------
    def export(self, index: int) -> Bucket | None:
        """Gather bucket ``index``; rank 0 returns it as a :class:`Bucket` (other ranks ``None``)."""
        if self._coding:
            payload, encoding = self._encode(index)
            return Bucket(self._entries(index), payload.cpu().numpy(), encoding) if encoding is not None else None
        tensors = dict(self._gather(index))
        if self.source.rank != 0:
            return None
        entries = self._entries(index)
        return Bucket(entries, flatten_bucket(tensors, entries, "cpu").numpy())

    # -- delta sync: rank 0 codes each bucket against what the engines hold -----------------------------
    def _encode(self, index: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Encoding | None]:
        """Gather bucket ``index`` (a collective); rank 0 codes it (other ranks ``(empty, None)``; a
        full bucket is written into ``out`` where given)."""
        tensors = dict(self._gather(index))
        if self.source.rank != 0:
            return torch.empty(0, dtype=torch.uint8), None
        assert self.delta is not None
        return self.delta.encode(tensors, self._entries(index), out)

    def encode(self, index: int) -> Encoding | None:
        """Broadcast with delta sync: gather and code bucket ``index``, kept for :meth:`broadcast`;
        rank 0 returns its encoding (the receivers size their buffers from it)."""
        payload, encoding = self._encode(index)
        self._encoded = payload if encoding is not None else None
        return encoding

    def base_buckets(self, entries: list[list[Entry]]) -> list[Bucket]:
        """Rank 0: buckets in full from the delta base, to repair engines whose checksums did not match."""
        if self.delta is None:
            raise RuntimeError("base_buckets without delta sync (configure_delta was not called)")
        out = []
        for bucket_entries_ in entries:
            payload, encoding = self.delta.full(bucket_entries_)
            out.append(Bucket(list(bucket_entries_), payload.numpy(), encoding))
        return out

    # -- colocated: every rank loads its own engine replica ------------------------------------------------
    def load_local(self, dtype: torch.dtype | None, version: int) -> dict[str, float]:
        """Gather the changed weights bucket by bucket into this rank's engine replica, then set its
        ``weight_version``."""
        engine = self.source.engine
        if engine is None:
            raise RuntimeError(f"Training rank {self.source.rank} holds no rollout engine (colocated sync before "
                               "Rollout.connect)")
        buckets, skipped = self.plan(dtype, only_changed=True)
        self._coding = False  # a colocated engine copies in place: a diff scan reads as much as the copy writes
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
        """Gather bucket ``index``; rank 0 broadcasts its bytes (with delta sync: the payload
        :meth:`encode` coded)."""
        if self._coding:
            payload, self._encoded = self._encoded, None
        else:
            tensors = dict(self._gather(index))
            payload = flatten_bucket(tensors, self._entries(index), self.source.device) if self.source.rank == 0 else None
        if self.source.rank == 0:
            if self._group is None:
                raise RuntimeError("broadcast before join_group (the transport was not connected)")
            if payload is None:
                raise RuntimeError(f"broadcast of bucket {index} before encode (delta sync codes each bucket first)")
            self._group.broadcast(payload.to(self.source.device))

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

    def write_slot(self, index: int) -> int | Encoding | None:
        """Gather bucket ``index`` into slot ``index % 2`` in wire layout; returns its bytes (with
        delta sync, rank 0 writes the coded payload and returns its encoding; the rollout processes'
        load calls take rank 0's result as an argument, so they run after it)."""
        entries = self._entries(index)
        nbytes = bucket_nbytes(entries)
        out = self._slots.slot(index, nbytes) if self._slots is not None else None
        if self._coding:
            if self.source.rank == 0 and out is None:
                raise RuntimeError("write_slot before create_slots (the transport was not connected)")
            payload, encoding = self._encode(index, out)
            if encoding is not None and payload.data_ptr() != out.data_ptr():  # a delta: a full one is in place
                out[:encoding.nbytes].copy_(payload)
            return encoding
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
