"""``WeightSync``: the one owner of pushing a strategy's weights to the engine it connected.

It holds the push in flight, the thread that runs a background push, and the versions, so the
Trainer, the step, the pipelines and export ask it instead of each other:

- :meth:`push` at the end of a step: ``mode="wait"`` pushes and waits (its metrics go to this step),
  ``"background"`` pushes in a thread while logging, callbacks and loading the next prompts go on,
  ``"overlap"`` starts the push and returns (the engines receive while they generate, see
  :mod:`rltrainer.weights.staging`).
- :meth:`wait` before anything that must see the new weights (a rollout, validation, a checkpoint,
  an export): the push's metrics plus ``timing_s/wait_weights``.
- :meth:`sync`: push the current version and wait (setup, resume).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rltrainer.controller.watchdog import Watchdog
from rltrainer.weights.transports import sync_metrics

if TYPE_CHECKING:
    from rltrainer.rollout.engine import RolloutEngine
    from rltrainer.strategies.strategy import Strategy

#: How a step's push relates to the next step (see the module docstring).
PUSH_MODES = ("wait", "background", "overlap")


class WeightSync:
    """Pushes ``strategy``'s weights into ``engine``, one push at a time, each wait watched by ``watchdog``."""

    def __init__(self, strategy: Strategy, engine: RolloutEngine, watchdog: Watchdog, mode: str = "wait") -> None:
        if mode not in PUSH_MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, PUSH_MODES))}, got {mode!r}")
        self.strategy, self.engine, self.watchdog, self.mode = strategy, engine, watchdog, mode
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | Any | None = None  # a Future (background) or a transport's handle

    def push(self, version: int) -> dict[str, float]:
        """End of a step: push the new weights as ``version`` (see :data:`PUSH_MODES`); the metrics
        of whatever push this waited for."""
        metrics = self.wait()  # one push at a time
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
        return self.watchdog.call("weights.push", self._start(version).wait)

    def close(self) -> None:
        """Wait out a push in flight (its error is not raised: the run is already ending) and stop the thread."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _start(self, version: int) -> Any:
        """Start a push; requests keep going meanwhile (a replica changes weights between two of
        them, see :mod:`rltrainer.weights.staging`). Requests sent once it returns ask for this
        version: replicas where it has not arrived yet wait for it."""
        handle = self.watchdog.call("weights.push", self.strategy.start_weight_sync, self.engine, version)
        self.engine.weight_version = version
        return handle
