"""``WeightSync``: the one owner of pushing a strategy's weights to the engine it connected.

The Strategy builds it when it connects an engine (:meth:`Strategy.connect
<rltrainer.strategies.strategy.Strategy.connect>`); no one else does. It holds the push in flight,
the thread that runs a background push, and the controller's version counters
(:class:`~rltrainer.weights.versions.WeightVersions`, see that module for every version's meaning),
so the Trainer, the step, the pipelines and export ask it instead of each other:

- :meth:`push` at the end of a step: ``mode="wait"`` pushes and waits (its metrics go to this step),
  ``"background"`` pushes in a thread while logging, callbacks and loading the next prompts go on,
  ``"overlap"`` starts the push and returns (the engines receive while they generate, see
  :mod:`rltrainer.weights.staging`).
- :meth:`wait` before anything that must see the new weights (a rollout, validation, a checkpoint,
  an export): the push's metrics plus ``timing_s/wait_weights``.
- :meth:`sync`: push the current version and wait (setup, resume).
- :meth:`start_weight_sync`: start one sync and return its handle (what the others use).

On the controller's side, ``engine.weight_version`` is written here only (:meth:`_hold`): when a
push has started (the version the next requests ask for) and when a sync has loaded.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from rltrainer.controller.watchdog import Watchdog
from rltrainer.weights.transports import SyncHandle, WeightTransport, sync_metrics
from rltrainer.weights.versions import WeightVersions

if TYPE_CHECKING:
    from rltrainer.rollout.engine import RolloutEngine

#: How a step's push relates to the next step (see the module docstring).
PUSH_MODES = ("wait", "background", "overlap")


class SyncSource(Protocol):
    """What the owner needs from its strategy (a :class:`~rltrainer.strategies.strategy.Strategy`)."""

    def transport_for(self, engine: RolloutEngine) -> WeightTransport: ...

    def forget_synced(self) -> None: ...


class WeightSync:
    """Pushes ``strategy``'s weights into ``engine``, one push at a time, each wait watched by
    ``watchdog`` (``None``: a watchdog with the defaults, which leaves waits in this process unwatched)."""

    def __init__(self, strategy: SyncSource, engine: RolloutEngine, watchdog: Watchdog | None = None,
                 mode: str = "wait") -> None:
        if mode not in PUSH_MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, PUSH_MODES))}, got {mode!r}")
        self.strategy, self.engine, self.mode = strategy, engine, mode
        self.watchdog = watchdog if watchdog is not None else Watchdog()
        self.versions = WeightVersions()  # policy / started / loaded: written here only
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | Any | None = None  # a Future (background) or a transport's handle

    def push(self, version: int) -> dict[str, float]:
        """End of a step: push the new weights as ``version`` (see :data:`PUSH_MODES`); the metrics
        of whatever push this waited for."""
        metrics = self.wait()  # one push at a time
        self.versions.policy = version
        if self.mode == "background":
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rltrainer-weight-sync")
            start, dog = self._start, self.watchdog  # the push is watched in its thread
            self._pending = self._executor.submit(dog.call, "weights.push", lambda: start(version).wait())
            return metrics
        self._pending = self._start(version)
        if self.mode == "wait":
            metrics.update(self.wait())
        return metrics

    def wait(self) -> dict[str, float]:
        """Wait for the push in flight (if any); its metrics plus ``timing_s/wait_weights``."""
        if self._pending is None:
            return {}
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        metrics = sync_metrics(self.watchdog.result("weights.push", pending))
        metrics["timing_s/wait_weights"] = time.perf_counter() - start
        return metrics

    def sync(self, version: int) -> dict[str, float]:
        """Push ``version`` and wait. Returns the transport's stats: ``tensors``, ``bytes``,
        ``skipped`` (unchanged since the last sync) and ``seconds``."""
        self.wait()
        self.versions.policy = version
        return self.watchdog.call("weights.push", self._start(version).wait)

    def close(self) -> None:
        """Wait out a push in flight (its error is not raised: the run is already ending) and stop the thread."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def start_weight_sync(self, version: int) -> SyncHandle:
        """Start pushing the policy's changed weights into the engine (cast to its dtype) as
        ``version``; returns once the trainer side has handed the bytes off.

        ``handle.wait()`` returns once every replica has loaded them, with the stats ``tensors``,
        ``bytes``, ``skipped`` (unchanged since the last sync), ``buckets`` and ``seconds``; from then
        on ``engine.weight_version == version`` (for remote replicas, in their processes too: they
        set it when their last bucket loads, even if nothing changed). The engine-side loads are
        submitted before this returns, so a later ``engine.generate`` runs on the new weights.
        One sync is in flight at a time: starting another first waits for this one. If a sleep
        discarded the engine's weights (``engine.weights_discarded``), this sync sends every weight.
        """
        engine = self.engine
        if getattr(engine, "weights_discarded", False):
            self.strategy.forget_synced()
            engine.weights_discarded = False
        self.versions.started = version
        return self.strategy.transport_for(engine).start(version, on_loaded=self._loaded)

    def _start(self, version: int) -> Any:
        """Start a push; requests keep going meanwhile (a replica changes weights between two of
        them, see :mod:`rltrainer.weights.staging`). Requests sent once it returns ask for this
        version: replicas where it has not arrived yet wait for it."""
        handle = self.watchdog.call("weights.push", self.start_weight_sync, version)
        self._hold(version)
        return handle

    def _loaded(self, version: int) -> None:
        self.versions.loaded = version
        self._hold(version)  # a controller-side handle (RemoteEngine) mirrors its replicas

    def _hold(self, version: int) -> None:
        """The controller's one write of ``engine.weight_version``."""
        self.engine.weight_version = version
