"""Transports: how a sync's buckets get from the training ranks to the rollout engines. Each one
is driven from the controller through one interface:

- :meth:`WeightTransport.start` ``(version) -> SyncHandle`` hands the changed weights off and
  returns; the engine-side receive calls are submitted before it returns.
- :meth:`SyncHandle.wait` returns the stats once every replica has loaded the sync: ``tensors``,
  ``bytes`` (counted by the first replica), ``skipped`` (unchanged since the last sync),
  ``buckets``, ``seconds`` (from start to loaded).

Split placement's rollout processes receive in a thread of their own, beside the request they
are generating, and stage each bucket; the sync is applied between two requests once its last
bucket is in, and a request that asks for its version (the Trainer's requests do once ``start``
has returned) waits for it (:mod:`rltrainer.weights.staging`). Every receive call names its sync's version, its bucket's
index and the sync's number of buckets. At most two buckets are in flight: starting bucket ``i``
waits until bucket ``i - 2`` is staged (copied out of the sender's buffer), never for a request,
so ``start`` returns once the last bucket is handed off, and the sender's memory stays about two
buckets. One sync is in flight per transport: ``start`` first waits for the previous one.

| transport | where the engines are | how the bytes move |
| --- | --- | --- |
| :class:`InProcessTransport` | in the controller | the strategy's ``export_weights`` stream, loaded directly |
| :class:`ColocatedTransport` | one in each training rank | each rank loads its replica from its own gather |
| :class:`ObjectStoreTransport` | rollout processes, any node | rank 0 puts each bucket in Ray's object store |
| :class:`BroadcastTransport` | rollout processes, GPUs (NCCL) | rank 0 broadcasts each bucket over a group of their own |
| :class:`SharedMemoryTransport` | rollout processes on rank 0's node | rank 0 writes each bucket into a ``/dev/shm`` slot they mapped |

The groups are the controller's worker groups (``rltrainer.controller``), called through their
typed remote methods only (``group.remote.plan_weights(dtype, True)``; ``.start(...)`` returns a
call in flight with ``get()``, ``ref()`` and ``as_call``, see ``rltrainer.controller.methods``);
``wait_all`` is ``rltrainer.controller.get_together``, which waits for calls to several groups as
one and turns a failure into a ``WorkerError`` naming the worker (the other groups, which may be
blocked on it, are shut down). The protocol, both ends (each method runs its namesake on the
rank's :class:`~rltrainer.weights.sender.WeightSender` or the process's
:class:`~rltrainer.weights.receiver.WeightReceiver`):

| training ranks (``TrainingWorker``) | rollout processes (``Worker``) |
| --- | --- |
| ``plan_weights(dtype, only_changed)``, ``weight_entries()`` (rank 0), ``finish_weights()`` | ``commit_weights(version)`` (a sync with nothing to send) |
| ``load_local_weights(dtype, version)`` (colocated) | |
| ``export_bucket(index)`` | ``load_bucket(bucket, version, index, count)`` |
| ``host_weight_group(...)``, ``broadcast_bucket(index)``, ``leave_weight_group()`` (rank 0) | ``weight_group_ranks()``, ``join_weight_group(..., rank_offset)``, ``receive_bucket(entries, version, index, count)`` |
| ``weight_slot_bytes(dtype)``, ``create_weight_slots(...)``, ``unlink_weight_slots()`` (rank 0), ``share_weight_slots(...)``, ``write_slot(index)``, ``close_weight_slots()`` | ``open_weight_slots(paths, nbytes)``, ``load_slot(index, entries, ready, version, count)`` |

Their waits are the watchdog's stages ``<group>.send_weights`` and ``<group>.receive_weights``.
"""

from __future__ import annotations

import abc
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rltrainer.weights.group import DEFAULT_TIMEOUT_S
from rltrainer.weights.shm import shared_memory_room
from rltrainer.weights.versions import mark_loaded

log = logging.getLogger(__name__)

WEIGHT_TRANSPORTS = ("auto", "broadcast", "object_store", "shared_memory")
Call = tuple[Any, Sequence[Any], str]  # (group, futures, method)
WaitAll = Callable[[Sequence[Call]], list[list[Any]]]
Stats = dict[str, float]


def resolve_transport(requested: str, devices: set[str], same_node: bool) -> str:
    """``Rollout(transport=...)`` for split placement, ``"auto"`` resolved: broadcast when trainer rank 0
    and every rollout process are on GPUs (NCCL), shared memory when they are all on trainer rank
    0's node, else Ray's object store."""
    if requested not in WEIGHT_TRANSPORTS:
        raise ValueError(f"transport={requested!r}; choose from {', '.join(WEIGHT_TRANSPORTS)} "
                         "(how split placement moves weights to the rollout replicas)")
    if requested == "shared_memory" and not same_node:
        raise ValueError("Rollout(transport='shared_memory') needs every rollout process on trainer rank 0's node; "
                         "use 'object_store' (any node) or 'broadcast' (GPUs) across nodes")
    if requested != "auto":
        return requested
    if devices == {"cuda"}:
        return "broadcast"
    return "shared_memory" if same_node and shared_memory_room() > 0 else "object_store"


class SyncHandle:
    """A started sync of ``version``; :meth:`wait` returns its stats once loaded (idempotent: a
    second call returns the same stats, or raises the same error)."""

    def __init__(self, version: int, finish: Callable[[], Stats], started: float,
                 on_loaded: Callable[[int], None] | None = None) -> None:
        self.version, self._finish, self._started, self._on_loaded = version, finish, started, on_loaded
        self._stats: Stats | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has returned (or raised)."""
        return self._stats is not None or self._error is not None

    def wait(self) -> Stats:
        if self._error is not None:
            raise self._error
        if self._stats is None:
            try:
                stats = dict(self._finish())
            except BaseException as exc:
                self._error = exc
                raise
            stats["seconds"] = time.perf_counter() - self._started
            self._stats = stats
            if self._on_loaded is not None:
                self._on_loaded(self.version)
        return dict(self._stats)


def delta_stats(totals: dict[str, float], buckets: int) -> dict[str, float]:
    """A delta sync's shares from its summed bucket stats: ``changed_share`` (words that differ from
    what the engines held, of the words compared: a scan that finds too many stops, and a bucket
    backing off after that goes unscanned; a name the engines lack counts whole), ``wire_share``
    (bytes sent of a full sync's), ``full_buckets`` (sent whole: no base yet, or too much changed).
    ``apply_s`` (the first replica's apply and checksums; ``verify_s``: its checksums) and the
    sender's ``encode_s`` / ``checksum_s`` come summed as they are."""
    return {"changed_share": totals.get("changed_words", 0) / max(totals.get("scanned_words", 0), 1),
            "wire_share": totals.get("wire_bytes", 0) / max(totals.get("bytes", 0), 1),
            "full_buckets": buckets - totals.get("delta_buckets", 0)}


def sync_metrics(stats: dict[str, float]) -> dict[str, float]:
    """A sync's stats as step metrics: ``sync/tensors``, ``sync/bytes``, ``sync/skipped``, ``sync/gb_per_s``."""
    out = {f"sync/{k}": float(v) for k, v in stats.items() if k != "seconds"}
    seconds = stats.get("seconds")
    if seconds and "bytes" in stats:
        out["sync/gb_per_s"] = stats["bytes"] / seconds / 1e9
    return out


class WeightTransport(abc.ABC):
    """One way of moving a sync; see the module docstring for the contract."""

    name = "transport"

    def __init__(self) -> None:
        self._pending: SyncHandle | None = None

    def connect(self) -> None:
        """Set up what the transport needs once (a process group, shared-memory slots)."""

    def start(self, version: int, on_loaded: Callable[[int], None] | None = None) -> SyncHandle:
        """Hand the weights changed since the last sync off for loading as ``version``."""
        if self._pending is not None:
            self._pending.wait()  # its buffers and versions are about to be reused
        started = time.perf_counter()
        self._pending = SyncHandle(version, self._start(version), started, on_loaded)
        return self._pending

    def wait(self) -> Stats:
        """Wait for the last started sync (``{}`` if none was)."""
        return self._pending.wait() if self._pending is not None else {}

    @abc.abstractmethod
    def _start(self, version: int) -> Callable[[], Stats]:
        """Start a sync; return what finishes it (waits for the loads, returns the stats)."""

    def close(self) -> None:
        """Release what :meth:`connect` set up (idempotent; the workers may be gone)."""


class InProcessTransport(WeightTransport):
    """The engine lives in the controller: pull ``source.export_weights(dtype, only_changed=True)``
    (which marks what it yields synced once exhausted) into ``engine.update_weights``. Loads
    before :meth:`start` returns. Where the source yields its live parameters
    (``exports_live_parameters``) and the engine shares weights (``shares_weights``), it calls
    ``engine.bind_weights`` instead: the engine's parameters become the policy's storage, so a
    sync copies nothing (``bytes`` 0, ``shared`` the tensors bound) and the model is held once."""

    name = "in_process"

    def __init__(self, source: Any, engine: Any) -> None:
        super().__init__()
        self.source, self.engine = source, engine

    def _start(self, version: int) -> Callable[[], Stats]:
        sent = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal sent
            for name, tensor in self.source.export_weights(dtype=getattr(self.engine, "dtype", None),
                                                           only_changed=True):
                sent += 1
                yield name, tensor

        share = getattr(self.source, "exports_live_parameters", False) and getattr(self.engine, "shares_weights", False)
        if share:
            loaded = dict(self.engine.bind_weights(stream()) or {})
        else:
            self.engine.start_weight_update()
            loaded = dict(self.engine.update_weights(stream()) or {})
            self.engine.finish_weight_update()
        mark_loaded(self.engine, version)  # the engine lives here: loaded before start returns
        stats = {"tensors": loaded.get("tensors", sent), "bytes": loaded.get("bytes", 0),
                 "skipped": len(self.source.weight_names()) - sent, "buckets": int(sent > 0)}
        if share:
            stats["shared"] = loaded.get("shared", 0)
        return lambda: stats


class ColocatedTransport(WeightTransport):
    """Each training rank gathers the changed weights bucket by bucket into its own replica."""

    name = "colocated"

    def __init__(self, trainer: Any, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.trainer, self.dtype = trainer, dtype

    def _start(self, version: int) -> Callable[[], Stats]:
        loads = self.trainer.remote.load_local_weights.start(self.dtype, version)
        return lambda: loads.get()[0]


class _Split(WeightTransport):
    """A transport from trainer rank 0 to rollout processes of their own, bucket by bucket."""

    depth = 2  # buckets in flight (the shared-memory transport has two slots)

    def __init__(self, trainer: Any, rollout: Any, dtype: torch.dtype | None, wait_all: WaitAll,
                 delta: bool = False) -> None:
        super().__init__()
        self.trainer, self.rollout, self.dtype, self.wait_all = trainer, rollout, dtype, wait_all
        self.delta = delta  # the training ranks code buckets (Rollout(delta=...), rltrainer.weights.delta)

    def _start(self, version: int) -> Callable[[], Stats]:
        trainer, rollout = self.trainer, self.rollout
        buckets, skipped = trainer.remote.plan_weights(self.dtype, True)[0]
        entries = trainer.remote.weight_entries() if buckets else []
        totals: dict[str, float] = {"tensors": 0, "bytes": 0}
        mismatched: list[list[int]] = []  # delta sync: per rollout process, buckets to send again in full
        in_flight: list[list[Call]] = []

        def finish_oldest() -> None:
            results = self.wait_all(in_flight.pop(0))
            for key, value in results[-1][0].items():  # the first replica's load
                if key != "mismatched":
                    totals[key] = totals.get(key, 0) + value
            for process, stats in enumerate(results[-1]):
                if stats.get("mismatched"):
                    mismatched.extend([] for _ in range(process + 1 - len(mismatched)))
                    mismatched[process].extend(stats["mismatched"])

        for index in range(buckets):
            while len(in_flight) >= self.depth:  # bucket i reuses bucket i - 2's buffers
                finish_oldest()
            in_flight.append(self._send(index, entries[index], version, buckets))
        if not buckets:  # nothing changed: the engines still take the version
            in_flight.append([rollout.remote.commit_weights.start(version).as_call])
        finished = trainer.remote.finish_weights.start()

        def finish() -> Stats:
            while in_flight:
                finish_oldest()
            finished.get()
            stats = {**totals, "skipped": skipped, "buckets": buckets}
            if self.delta:
                stats.update(delta_stats(totals, buckets), checksum_mismatches=sum(map(len, mismatched)))
                if mismatched:
                    self._repair(mismatched, entries, version)
            return stats

        return finish

    def _repair(self, mismatched: list[list[int]], entries: list[list[Any]], version: int) -> None:
        """Send the buckets whose checksums did not match again, in full from trainer rank 0's delta base,
        to the processes that reported them (their requests wait until then)."""
        wanted = sorted({index for indices in mismatched for index in indices})
        log.warning("Weight sync %d: %d rollout process(es) reported checksum mismatches in buckets %s; sending them "
                    "again in full", version, sum(map(bool, mismatched)), wanted)
        full = dict(zip(wanted, self.trainer.remote.base_buckets([entries[i] for i in wanted])))
        processes = self.rollout.world_size
        per_process = [([full[i] for i in sorted(set(mismatched[p]))] if p < len(mismatched) else [], version)
                       for p in range(processes)]
        self.wait_all([self.rollout.remote.repair_weights.each(per_process).as_call])

    @abc.abstractmethod
    def _send(self, index: int, entries: list[Any], version: int, count: int) -> list[Call]:
        """Submit bucket ``index`` of ``count`` of sync ``version`` (sender and receivers). The
        receivers' call comes last in the returned list."""


class ObjectStoreTransport(_Split):
    """Rank 0 returns each gathered bucket as a value (bytes in a numpy array), Ray's object store
    carries it to every replica: no extra process group, a copy through host memory per replica."""

    name = "object_store"

    def _send(self, index: int, entries: list[Any], version: int, count: int) -> list[Call]:
        exports = self.trainer.remote.export_bucket.start(index)
        bucket = exports.ref()  # resolved by Ray before the load runs
        loads = self.rollout.remote.load_bucket.start(bucket, version, index, count)
        return [exports.as_call, loads.as_call]


class BroadcastTransport(_Split):
    """Trainer rank 0 and every replica's receiving processes form a group of their own
    (:class:`~rltrainer.weights.group.WeightGroup`, NCCL when all are on GPUs, else gloo); each
    bucket is one broadcast straight into the receivers' buffers (or SGLang's schedulers).
    ``timeout_s`` (the rollout's ``sync_timeout_s``) bounds the group's forming and each
    broadcast, on every member."""

    name = "broadcast"

    def __init__(self, trainer: Any, rollout: Any, dtype: torch.dtype | None, wait_all: WaitAll,
                 timeout_s: float = DEFAULT_TIMEOUT_S, delta: bool = False) -> None:
        super().__init__(trainer, rollout, dtype, wait_all, delta)
        self.timeout_s = timeout_s
        self.group_name = f"rltrainer-weights-{uuid.uuid4().hex[:12]}"
        self.backend = "gloo"
        self.world_size = 0

    def connect(self) -> None:
        """Form the group: trainer rank 0 is rank 0; replica ``r`` takes as many ranks as its engine
        has receiving processes (SGLang: ``tp_size``), after the replicas before it."""
        trainer, rollout = self.trainer, self.rollout
        ranks = rollout.remote.weight_group_ranks()
        offsets = [1 + sum(ranks[:r]) for r in range(len(ranks))]
        self.world_size = 1 + sum(ranks)
        devices = [trainer.remote.device_type.on_rank_zero(), *rollout.remote.device_type()]
        self.backend = "nccl" if set(devices) == {"cuda"} else "gloo"
        address, port = trainer.remote.master_address()
        join = (address, port, self.world_size, self.group_name, self.backend, self.timeout_s)
        # receivers first: an in-process trainer blocks in its call until every member has joined
        receivers = rollout.remote.join_weight_group.each([(*join, off) for off in offsets])
        sender = trainer.remote.host_weight_group.start(*join)
        self.wait_all([receivers.as_call, sender.as_call])
        log.info("Weight broadcast group %s: %s, %d ranks (%s per replica)", self.group_name, self.backend,
                 self.world_size, ranks)

    def _send(self, index: int, entries: list[Any], version: int, count: int) -> list[Call]:
        if self.delta:  # the receivers size their buffers from the bucket's coding
            coded = self.trainer.remote.encode_bucket.start(index)
            receivers = self.rollout.remote.receive_bucket.start(entries, version, index, count, coded.ref())
            sender = self.trainer.remote.broadcast_bucket.start(index)
            return [coded.as_call, sender.as_call, receivers.as_call]
        receivers = self.rollout.remote.receive_bucket.start(entries, version, index, count)
        sender = self.trainer.remote.broadcast_bucket.start(index)
        return [sender.as_call, receivers.as_call]

    def close(self) -> None:
        _quietly(lambda: self.trainer.remote.leave_weight_group())


class SharedMemoryTransport(_Split):
    """Split placement on one node: trainer rank 0 writes each bucket's bytes into one of two
    slots in ``directory`` (shared memory) that every rollout process has mapped, and the rollout
    processes load views of it. When every training rank is on that node too, they map the slots
    as well, and a layout that can (FSDP2 on CPU) gathers straight into them: no extra copy.

    The slots are sized at :meth:`connect` for ``bucket_bytes`` (or the largest tensor) and their
    files unlinked as soon as every process has mapped them."""

    name = "shared_memory"

    def __init__(self, trainer: Any, rollout: Any, dtype: torch.dtype | None, wait_all: WaitAll,
                 directory: str = "/dev/shm", delta: bool = False) -> None:
        super().__init__(trainer, rollout, dtype, wait_all, delta)
        self.directory = directory
        self.tag = uuid.uuid4().hex[:12]  # the slots' files are named rltrainer-weights-{tag}-{slot}
        self.slot_bytes = 0

    def connect(self) -> None:
        trainer, rollout = self.trainer, self.rollout
        self.slot_bytes = trainer.remote.weight_slot_bytes(self.dtype)
        paths = trainer.remote.create_weight_slots(self.directory, self.tag, self.slot_bytes)
        try:
            everywhere = len(set(trainer.remote.node_ip())) == 1
            trainer.remote.share_weight_slots(paths, self.slot_bytes, everywhere)
            rollout.remote.open_weight_slots(paths, self.slot_bytes)
        finally:
            trainer.remote.unlink_weight_slots()
        log.info("Shared-memory weight slots: 2 x %.0f MiB in %s", self.slot_bytes / 2**20, self.directory)

    def _send(self, index: int, entries: list[Any], version: int, count: int) -> list[Call]:
        writes = self.trainer.remote.write_slot.start(index)
        ready = writes.ref()  # the loads run once rank 0 has written
        loads = self.rollout.remote.load_slot.start(index, entries, ready, version, count)
        return [writes.as_call, loads.as_call]

    def close(self) -> None:
        _quietly(lambda: self.trainer.remote.close_weight_slots())


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception as exc:  # the workers may be gone already
        log.debug("Ignored while closing a weight transport: %s", exc)
