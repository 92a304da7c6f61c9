"""A rollout process's side of weight sync: take what a transport delivers (a bucket value, a
broadcast, a shared-memory slot) and get it into the engine through ``RolloutEngine.update_weights``,
its only weight entry point.

A sync's buckets are staged, not loaded: each receive keeps its own copy of the bucket's bytes
(:class:`~rltrainer.weights.staging.EngineGate`), so receiving runs beside a ``generate`` in the
process's other thread; once the last bucket is in, the sync is applied between two requests
(``start_weight_update``, every bucket, ``finish_weight_update``) and the engine's
``weight_version`` becomes the sync's version. Each receive takes ``(version, index, count)``: its
sync's version, its bucket's index and the sync's number of buckets.

An engine with a native receiving path (SGLang's schedulers join the broadcast group and
receive flattened buckets themselves) says so with ``native_weight_broadcast = True``; the
receiver then drives its hooks (``init_weight_group``, ``receive_weights``, ``close_weight_group``)
instead of receiving for it, holding the engine from the sync's first bucket to its last.

:class:`WeightReceiver` is composed into a rollout process (``Worker``), which calls it through
its typed remote methods (``Worker.load_bucket``, ``receive_bucket``, ``load_slot``...: the table in
:mod:`rltrainer.weights.transports`), each running its namesake here on the process's engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rltrainer.weights.delta import DeltaDecoder, DeltaSync
from rltrainer.weights.group import WeightGroup
from rltrainer.weights.shm import SharedSlots
from rltrainer.weights.staging import EngineGate
from rltrainer.weights.versions import mark_loaded
from rltrainer.weights.wire import Bucket, Encoding, Entry, bucket_nbytes, empty_bucket

Stats = dict[str, float]


class WeightReceiver:
    """Args:
        device: where this process receives broadcast buffers and stages syncs.
        gate: the process's engine access (shared with its requests).
    """

    def __init__(self, device: torch.device, gate: EngineGate) -> None:
        self.device, self.gate = device, gate
        self.stage_device = device  # where a sync's buckets wait to be applied
        self._group: WeightGroup | None = None
        self._slots: SharedSlots | None = None

    def configure_delta(self, settings: DeltaSync | None) -> None:
        """Delta sync on (``settings``) or off: its ``copies`` place the mirror and the staged buckets
        (host memory, or this process's device as without delta sync)."""
        self.gate.decoder = DeltaDecoder(settings)
        self.stage_device = settings.home(self.device) if settings is not None else self.device

    def _own(self, data: torch.Tensor | np.ndarray) -> torch.Tensor:
        """This process's copy of a payload (uint8), where it stages syncs."""
        if isinstance(data, np.ndarray):
            return torch.tensor(data, device=self.stage_device)
        return data.to(self.stage_device, copy=True)

    def _staged(self, engine: Any, buffer: torch.Tensor, entries: Sequence[Entry], version: int, index: int,
                count: int, encoding: Encoding | None = None) -> Stats | dict[str, Any]:
        """Stage bucket ``index`` of ``count`` (``buffer``: this process's own copy of its payload);
        after the last, wait until the sync is applied. With delta sync the stats carry the
        bucket's coding, and the last bucket's ``mismatched``: the buckets whose checksums did not
        match (the controller sends them again, :meth:`repair`)."""
        if encoding is not None and encoding.kind == "delta" and engine.native_weight_broadcast:
            raise RuntimeError(f"{type(engine).__name__} receives broadcast buckets itself and cannot apply a delta; "
                               "use Rollout(delta=False) with it")
        staged = self.gate.stage(version, index, count, buffer, entries, encoding)
        stats: dict[str, Any] = {"tensors": len(entries), "bytes": bucket_nbytes(entries)}
        if encoding is not None:
            stats.update(encoding.stats())
        if staged is not None:
            self.gate.commit(engine, staged)
            if encoding is not None:
                stats["mismatched"] = list(staged.mismatched)
                stats["apply_s"] = staged.apply_s
                stats["verify_s"] = staged.verify_s
        return stats

    def repair(self, engine: Any, buckets: Sequence[Bucket], version: int) -> Stats:
        """Load buckets of sync ``version`` again in full (their checksums did not match after the
        sync was applied; requests have waited since), verify them, and set the version."""
        if not buckets:
            return {"tensors": 0, "bytes": 0}
        self.gate.acquire()
        try:
            engine.start_weight_update()
            bad = [i for i, bucket in enumerate(buckets)
                   if not self.gate.decoder.apply(engine, self._own(bucket.data), bucket.entries,
                                                  bucket.encoding)]
            engine.finish_weight_update()
            if bad:
                raise RuntimeError(f"Weight sync {version}: buckets sent again in full still do not match the "
                                   f"trainer's checksums ({len(bad)} of {len(buckets)}): the engine does not load "
                                   "the bytes it is given")
            mark_loaded(engine, version)
        except BaseException as exc:
            self.gate.release(failure=(version, exc))
            raise
        self.gate.release(repaired=True)
        return {"tensors": sum(len(b.entries) for b in buckets), "bytes": sum(b.nbytes for b in buckets)}

    def load(self, engine: Any, bucket: Bucket, version: int | None = None, index: int = 0,
             count: int = 1) -> Stats:
        """A bucket value (the object store's, or one the controller packed): bucket ``index`` of
        ``count`` of sync ``version``, or, with ``version=None``, weights loaded now, outside a sync
        (the engine's ``weight_version`` stays): one update session over the ``count`` buckets, the
        engine held from the first to the last (vLLM rebuilds a layer from all its tensors in one session)."""
        if version is None:
            self._held(engine, index, count, None, lambda: engine.update_weights(bucket.views()))
            return {"tensors": len(bucket.entries), "bytes": bucket.nbytes}
        owned = self._own(bucket.data)  # a copy: the object store's buffer is released
        return self._staged(engine, owned, bucket.entries, version, index, count, bucket.encoding)

    def commit(self, engine: Any, version: int) -> Stats:
        """A sync with nothing to send still moves the engine's version (between two requests)."""
        self.gate.commit(engine, version)
        return {"tensors": 0, "bytes": 0}

    @staticmethod
    def take_weights_discarded(engine: Any) -> bool:
        """Whether a sleep discarded the engine's weights (then the next sync must send every
        weight); the engine's flag is reset, the controller keeps the answer until that sync."""
        discarded = bool(getattr(engine, "weights_discarded", False))
        engine.weights_discarded = False
        return discarded

    # -- collective broadcast ----------------------------------------------------------------------------
    @staticmethod
    def group_ranks(engine: Any) -> int:
        """Ranks this process's engine takes in the broadcast group (one per receiving process)."""
        return engine.weight_group_ranks

    def join_group(self, engine: Any, address: str, port: int, world_size: int, group_name: str, backend: str,
                   timeout_s: float, rank_offset: int) -> None:
        """Join the group whose rank 0 (trainer rank 0) hosts a ``TCPStore`` at ``address:port``, as
        ranks ``rank_offset ..`` (one, or the engine's own ``weight_group_ranks``). Every member joins
        at once; this returns when all have, or raises after ``timeout_s``."""
        self.leave_group(engine)
        if engine.native_weight_broadcast:
            engine.init_weight_group(address, port, rank_offset, world_size, group_name, backend,
                                     device=self.device, timeout_s=timeout_s)
        else:
            self._group = WeightGroup(address, port, rank_offset, world_size, group_name, backend, timeout_s)

    def receive(self, engine: Any, entries: Sequence[Entry], version: int, index: int, count: int,
                encoding: Encoding | None = None) -> Stats:
        """Receive broadcast bucket ``index`` of ``count`` of sync ``version`` (coded as ``encoding``
        with delta sync)."""
        if engine.native_weight_broadcast and encoding is None:
            return self._receive_native(engine, entries, version, index, count)
        if self._group is None:
            raise RuntimeError("receive before join_group (the broadcast transport was not connected)")
        if encoding is None:
            buffer = empty_bucket(entries, self.device)  # kept as the staged copy
        else:
            buffer = torch.empty(encoding.nbytes, dtype=torch.uint8, device=self.device)
        self._group.broadcast(buffer)
        if self.stage_device != self.device:  # staged elsewhere (host memory): the receive buffer is freed
            buffer = self._own(buffer)
        return self._staged(engine, buffer, entries, version, index, count, encoding)

    def _receive_native(self, engine: Any, entries: Sequence[Entry], version: int, index: int, count: int) -> Stats:
        """The engine loads each bucket as it arrives: it is held from the first bucket to the last."""
        stats = dict(self._held(engine, index, count, version,
                                lambda: engine.receive_weights(entries, index == count - 1)) or {})
        return {"tensors": stats.get("tensors", len(entries)), "bytes": stats.get("bytes", bucket_nbytes(entries))}

    def _held(self, engine: Any, index: int, count: int, version: int | None, load: Any) -> Any:
        """Bucket ``index`` of ``count`` loaded as it arrives, in one update session with the engine
        held from the first bucket to the last (ahead of the next request); the last sets
        ``version`` (``None``: a load outside a sync keeps the engine's). Returns what ``load`` returned."""
        if index == 0:
            self.gate.acquire(version)  # a sync waits for the rollouts that hold an older version
        try:
            if index == 0:
                engine.start_weight_update()
            out = load()
            if index == count - 1:
                engine.finish_weight_update()
                if version is not None:
                    mark_loaded(engine, version)
        except BaseException as exc:
            self.gate.release(failure=(engine.weight_version if version is None else version, exc))
            raise
        if index == count - 1:
            self.gate.release()
        return out

    def leave_group(self, engine: Any) -> None:
        if engine is not None and engine.native_weight_broadcast:
            engine.close_weight_group()
        if self._group is not None:
            self._group.close()
            self._group = None

    # -- shared memory ----------------------------------------------------------------------------------
    def open_slots(self, engine: Any, paths: list[str], nbytes: int) -> None:
        """Map trainer rank 0's two slots (before it unlinks them)."""
        self.close_slots()
        self._slots = SharedSlots.open(paths, nbytes)

    def load_slot(self, engine: Any, index: int, entries: Sequence[Entry], ready: Any, version: int,
                  count: int) -> Stats:
        """Stage bucket ``index`` of ``count`` of sync ``version`` from its slot (``ready``: trainer
        rank 0's write, resolved first); the slot is copied, so rank 0 may reuse it at once."""
        if self._slots is None:
            raise RuntimeError("load_slot before open_slots (the shared-memory transport was not connected)")
        encoding = ready if isinstance(ready, Encoding) else None  # delta sync: rank 0's coded payload
        nbytes = encoding.nbytes if encoding is not None else bucket_nbytes(entries)
        owned = self._own(self._slots.slot(index, bucket_nbytes(entries))[:nbytes])
        return self._staged(engine, owned, entries, version, index, count, encoding)

    def close_slots(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def close(self, engine: Any) -> None:
        self.leave_group(engine)
        self.close_slots()
