"""A rollout process's side of weight sync: take what a transport delivers (a bucket value, a
broadcast, a shared-memory slot) and hand the engine ``(hf_name, tensor)`` views to load with
``RolloutEngine.update_weights``, its only weight entry point. When the last bucket of a sync has
loaded, the engine's ``weight_version`` becomes the sync's version.

An engine with a native receiving path (SGLang's schedulers join the broadcast group and
receive flattened buckets themselves) says so with ``native_weight_broadcast = True``; the
receiver then drives its hooks (``init_weight_group``, ``receive_weights``, ``close_weight_group``)
instead of receiving for it.

:class:`WeightReceiver` is composed into a rollout process (``Worker``), which calls it through
``Worker.receive_weights(op, ...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rltrainer.weights.group import WeightGroup
from rltrainer.weights.shm import SharedSlots
from rltrainer.weights.wire import Bucket, Entry, bucket_nbytes, bucket_views, empty_bucket


class WeightReceiver:
    """Args:
        device: where this process receives broadcast buffers.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._group: WeightGroup | None = None
        self._slots: SharedSlots | None = None
        self._updating = False  # between a sync's first and last bucket (the engine's update session)

    def _update(self, engine: Any, views: Any, version: int | None, last: bool | None = None) -> dict[str, float]:
        """Load one bucket's ``(name, tensor)`` views: the sync's first bucket opens the engine's
        update session (``start_weight_update``), its last (``last``; by default: ``version`` given)
        closes it (``finish_weight_update``)."""
        if not self._updating:
            engine.start_weight_update()
            self._updating = True
        try:
            stats = engine.update_weights(views)
            if last or (last is None and version is not None):
                self._updating = False
                engine.finish_weight_update()
        except BaseException:
            self._updating = False
            raise
        return self._loaded(engine, stats, version)

    @staticmethod
    def _loaded(engine: Any, stats: dict[str, float] | None, version: int | None) -> dict[str, float]:
        if version is not None:  # the sync's last bucket
            engine.weight_version = version
        stats = dict(stats or {})
        return {"tensors": stats.get("tensors", 0), "bytes": stats.get("bytes", 0)}

    def load(self, engine: Any, bucket: Bucket, version: int | None, last: bool | None = None) -> dict[str, float]:
        """Load a bucket value (the object store's, or one the controller packed); ``last`` ends the
        update (by default the bucket that carries a ``version`` does)."""
        return self._update(engine, bucket.views(), version, last)

    def commit(self, engine: Any, version: int) -> dict[str, float]:
        """A sync with nothing to send still moves the engine's version."""
        return self._loaded(engine, None, version)

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

    def receive(self, engine: Any, entries: Sequence[Entry], version: int | None) -> dict[str, float]:
        """Receive one broadcast bucket (``version`` given on the sync's last)."""
        if engine.native_weight_broadcast:
            return self._loaded(engine, engine.receive_weights(entries, version is not None), version)
        if self._group is None:
            raise RuntimeError("receive before join_group (the broadcast transport was not connected)")
        buffer = empty_bucket(entries, self.device)
        self._group.broadcast(buffer)
        return self._update(engine, bucket_views(buffer, entries), version)

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

    def load_slot(self, engine: Any, index: int, entries: Sequence[Entry], ready: Any,
                  version: int | None) -> dict[str, float]:
        """Load bucket ``index`` from its slot (``ready``: trainer rank 0's write, resolved first)."""
        if self._slots is None:
            raise RuntimeError("load_slot before open_slots (the shared-memory transport was not connected)")
        views = bucket_views(self._slots.slot(index, bucket_nbytes(entries)), entries)
        return self._update(engine, views, version)

    def close_slots(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def close(self, engine: Any) -> None:
        self.leave_group(engine)
        self.close_slots()
