"""A rollout process's staged syncs, and the gate that gives its engine to one caller at a time.

Split placement runs each rollout process with two threads (Ray concurrency groups, see
``rltrainer.rollout.worker.Worker``): requests (``generate``, and every other engine call) in
one, weight receives in the other. A receive does not touch the engine: it keeps its bucket's bytes
in a :class:`StagedSync` (one buffer per bucket on the process's device, owned by the receiver),
so a sync's bytes arrive while a request generates. When a sync's last bucket has arrived, its
weights are applied to the engine in one go, between two requests:
``engine.start_weight_update()``, ``engine.update_weights`` for every bucket in order,
``engine.finish_weight_update()``, then ``engine.weight_version`` becomes the sync's version.

:class:`EngineGate` makes that safe and prompt:

- The engine has one user at a time (a request, a load, a sleep): it never sees ``update_weights``
  while it generates, and a request's tokens all come from one weight version.
- A request asks for a version (``min_version``: the version the controller had started pushing
  when it submitted the request) and waits until it has arrived; the request that is already
  generating when a push starts keeps its weights to the end.
- The next request applies a complete staged sync before it generates, and the receive of the last
  bucket waits until it is applied (at most one request's time, the one generating, unless a hold
  keeps it out, see below), so a sync's ``wait`` means loaded and at most one sync is staged per process.

Memory: a staged sync holds every bucket it carries until it is applied, so each replica needs
one copy of the weights that changed since the last sync (all of them on the first sync, or after a
sleep discarded them) on its device, beside the engine's own weights; with delta sync, in host
memory unless ``DeltaSync(copies="device")`` (the receiver places them,
:meth:`~rltrainer.weights.receiver.WeightReceiver.configure_delta`).

An engine with a receiving path of its own (``native_weight_broadcast``, SGLang's schedulers) loads
each bucket as it arrives; the receiver then holds the gate from the sync's first bucket to its last,
so that sync waits for the request generating when it starts (and later requests wait for it).

Holds (a seeded run's schedule, :mod:`rltrainer.pipelines`): the controller may assign a rollout a
weight version ahead of time and :meth:`EngineGate.hold` it before pushing anything newer; until
the rollout is over (:meth:`EngineGate.release_hold`), no sync newer than a held version is applied,
by a request or by its receive, and a request that needs such a sync waits. The held rollout's
requests (``min_version``: the held version) then run on exactly that version, whatever the timing.
A held sync's bytes still arrive while the engine generates; only applying it waits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrainer.weights.delta import DeltaDecoder
from rltrainer.weights.versions import mark_loaded
from rltrainer.weights.wire import Encoding, Entry, bucket_views

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StagedSync:
    """The buckets of sync ``version`` received so far (of ``count``), in order, with their bytes;
    ``applied`` once loaded into the engine (``error``: the load raised; ``mismatched``: the buckets
    whose checksums did not match, sent again in full by the controller, see :meth:`EngineGate.repair`)."""

    version: int
    count: int
    buckets: list[tuple[torch.Tensor, list[Entry], Encoding | None]] = field(default_factory=list)
    applied: bool = False
    error: BaseException | None = None
    mismatched: list[int] = field(default_factory=list)
    apply_s: float = 0.0  # delta sync: the engine side's apply and checksums, in seconds
    verify_s: float = 0.0  # of which checksums

    @property
    def complete(self) -> bool:
        return len(self.buckets) == self.count

    @property
    def done(self) -> bool:
        return self.applied or self.error is not None


class EngineGate:
    """One rollout process's engine access: see the module docstring."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False  # an engine call (or a native sync) holds the engine
        self._claims: list[int | None] = []  # versions of loads waiting for the engine (None: not a sync)
        self._staged: StagedSync | None = None  # the sync arriving, or arrived and not applied yet
        self._failed: tuple[int, BaseException] | None = None  # a load that raised: the engine is unusable
        self._repairing = False  # a sync's checksums did not match: requests wait for its repair
        self._holds: Counter[int] = Counter()  # held versions (rollouts assigned them): newer syncs wait
        self.decoder = DeltaDecoder()  # delta sync: applies coded buckets (and keeps a mirror if it must)

    # -- the requests' side -------------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, engine: Any, min_version: int = -1) -> Iterator[Any]:
        """Hold ``engine`` for one call, once it holds ``min_version`` or later (a complete staged
        sync is applied first). Only a process that receives in a thread of its own may wait for a
        version; one that receives in order with its requests passes ``-1``."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._busy and not self._claimed() and not self._repairing
                                    and self._arrived(engine, min_version))
                if self._failed is not None:
                    version, error = self._failed
                    raise RuntimeError(f"Loading weight sync {version} into this engine failed ({error!r}); its "
                                       "weights may be partly updated, so it takes no more requests") from error
                self._busy = True
                staged = self._take_complete()
            if staged is None:
                break
            try:
                self._apply(engine, staged)
            except BaseException:
                self._release()
                raise
            if not staged.mismatched:
                break
            self._release()  # the sync needs its repair first
        try:
            yield engine
        finally:
            self._release()

    def _arrived(self, engine: Any, version: int) -> bool:
        staged = self._staged
        return (engine.weight_version >= version or self._failed is not None
                or (staged is not None and staged.complete and staged.version >= version
                    and self._may_apply(staged.version)))

    # -- holds ----------------------------------------------------------------------------------------
    def hold(self, version: int) -> None:
        """A rollout assigned weight version ``version`` is coming: apply no newer sync until it is
        released. Holds count (one per rollout); a release may arrive before its hold."""
        with self._cond:
            self._holds[version] += 1

    def release_hold(self, version: int) -> None:
        """The rollout that held ``version`` is over."""
        with self._cond:
            self._holds[version] -= 1
            if not self._holds[version]:
                del self._holds[version]
            self._cond.notify_all()

    def _may_apply(self, version: int) -> bool:
        """Whether sync ``version`` may be applied: no rollout holds an older version."""
        return not any(count > 0 and held < version for held, count in self._holds.items())

    def _claimed(self) -> bool:
        """Whether a load waits for the engine and may take it now (requests let it go first; a sync
        kept out by a hold does not hold up the held rollout's requests)."""
        return any(version is None or self._may_apply(version) for version in self._claims)

    # -- the receiver's side ------------------------------------------------------------------------
    def stage(self, version: int, index: int, count: int, buffer: torch.Tensor, entries: Sequence[Entry],
              encoding: Encoding | None = None) -> StagedSync | None:
        """Keep bucket ``index`` of ``count`` of sync ``version`` (``buffer`` is the receiver's own
        copy of its payload, coded as ``encoding`` with delta sync); returns the sync once complete (for :meth:`commit`). Buckets arrive in
        order; bucket 0 starts a sync, dropping what is left of one that did not complete (it
        failed midway)."""
        with self._cond:
            staged = self._staged
            if index == 0:
                if staged is not None:
                    log.warning("Weight sync %d was dropped after %d of %d buckets (sync %d started)",
                                staged.version, len(staged.buckets), staged.count, version)
                staged = self._staged = StagedSync(version, count)
            elif staged is None or staged.version != version or len(staged.buckets) != index:
                have = "none" if staged is None else f"{len(staged.buckets)} of sync {staged.version}"
                raise RuntimeError(f"Bucket {index} of weight sync {version} arrived with {have} staged; a sync's "
                                   "buckets must arrive in order, from bucket 0")
            staged.buckets.append((buffer, list(entries), encoding))
            if not staged.complete:
                return None
            self._cond.notify_all()  # a request waiting for this version may apply it
            return staged

    def commit(self, engine: Any, staged: StagedSync | int) -> None:
        """Apply a complete staged sync (what :meth:`stage` returned; a version alone: a sync with
        nothing to send, which still moves the version) once the engine is free, unless a request
        applied it first; returns once it is loaded."""
        with self._cond:
            if isinstance(staged, int):
                staged = self._staged = StagedSync(staged, 0)
            self._claims.append(staged.version)
            try:
                self._cond.wait_for(lambda: (not self._busy and self._may_apply(staged.version)) or staged.done)
            finally:
                self._claims.remove(staged.version)
            mine = not staged.done
            if mine:
                assert self._staged is staged, "a complete sync was replaced before it was applied"
                self._busy, self._staged = True, None
        if mine:
            try:
                self._apply(engine, staged)
            finally:
                self._release()
        if staged.error is not None:
            raise RuntimeError(f"Loading weight sync {staged.version} into the engine failed") from staged.error

    def acquire(self, version: int | None = None) -> None:
        """Take the engine, ahead of the next request, until :meth:`release` (a native sync of
        ``version``, or a load outside a sync, holds it from its first bucket to its last, across
        calls). A sync waits until no rollout holds an older version."""
        with self._cond:
            self._claims.append(version)
            try:
                self._cond.wait_for(lambda: not self._busy and (version is None or self._may_apply(version)))
            finally:
                self._claims.remove(version)
            self._busy = True

    def release(self, failure: tuple[int, BaseException] | None = None, repaired: bool = False) -> None:
        """Give the engine back; ``failure``: ``(version, error)`` of a load that raised midway (the
        engine's weights may be partly updated: later requests raise); ``repaired``: a sync whose
        checksums did not match is whole again (requests may go on)."""
        with self._cond:
            if failure is not None:
                self._failed = failure
            if repaired or failure is not None:  # a failed repair: waiting requests raise, not wait on
                self._repairing = False
        self._release()

    # -- applying -----------------------------------------------------------------------------------
    def _take_complete(self) -> StagedSync | None:
        staged = self._staged
        if staged is None or not staged.complete or not self._may_apply(staged.version):
            return None
        self._staged = None
        return staged

    def _apply(self, engine: Any, staged: StagedSync) -> None:
        """Load a complete staged sync (the caller holds the engine): one update session, buckets in
        order, then the version."""
        mismatched = []
        start, verified = time.perf_counter(), self.decoder.verify_s
        try:
            if staged.buckets:
                engine.start_weight_update()
                for index, (buffer, entries, encoding) in enumerate(staged.buckets):
                    if encoding is None:
                        engine.update_weights(bucket_views(buffer, entries))
                    elif not self.decoder.apply(engine, buffer, entries, encoding):
                        mismatched.append(index)
                engine.finish_weight_update()
            if mismatched:
                log.warning("Weight sync %d: the checksums of buckets %s did not match the trainer's; they are sent "
                            "again in full", staged.version, mismatched)
            else:
                mark_loaded(engine, staged.version)
        except BaseException as exc:
            with self._cond:
                staged.error, self._failed = exc, (staged.version, exc)
            raise
        with self._cond:
            staged.applied, staged.mismatched, self._failed = True, mismatched, None
            staged.apply_s = time.perf_counter() - start
            staged.verify_s = self.decoder.verify_s - verified
            self._repairing = bool(mismatched)

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()
