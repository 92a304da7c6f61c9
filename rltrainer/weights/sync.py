"""``WeightSync``: the one owner of pushing a strategy's weights to the engine a rollout connected.

:meth:`Rollout.connect <rltrainer.rollout.rollout.Rollout.connect>` builds it; no one else does. It
holds the transport the rollout chose, the LoRA view the engine loads, the push in flight, the thread
that runs a background push, and the version last pushed (:attr:`WeightSync.version`; see
:mod:`rltrainer.weights.versions` for every version's meaning), so the Trainer, the step, the
pipelines and export ask it instead of each other. Its verbs:

- :meth:`push` a version: ``mode="wait"`` pushes and waits (its metrics go to this step),
  ``"background"`` pushes in a thread while logging, callbacks and loading the next prompts go on,
  ``"overlap"`` starts the push and returns (the engines receive while they generate, see
  :mod:`rltrainer.weights.staging`). The mode is the pipeline's (:data:`PUSH_MODES`); setup and
  resume push with ``mode="wait"``.
- :meth:`wait` before anything that must see the new weights (a rollout, validation, a checkpoint,
  an export): the push's metrics plus ``timing_s/wait_weights``.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from rltrainer.weights.transports import WeightTransport, sync_metrics
from rltrainer.weights.wire import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from rltrainer.controller.watchdog import Watchdog
    from rltrainer.rollout.engine import RolloutEngine

#: How a push relates to the next step (see the module docstring).
PUSH_MODES = ("wait", "background", "overlap")


class SyncSource(Protocol):
    """What the owner needs from the strategy whose weights it pushes (a
    :class:`~rltrainer.strategies.strategy.Strategy`)."""

    def forget_synced(self, groups: list[list[str]] | None = None) -> None: ...


class WeightSync:
    """Pushes ``source``'s weights into ``engine`` over ``transport``, one push at a time, each wait
    watched by ``watchdog``.

    Args:
        engine: the engine the controller calls (a :class:`~rltrainer.rollout.remote.RemoteEngine`
            for engines in processes of their own or in the training ranks).
        transport: how weights reach it (:mod:`rltrainer.weights.transports`).
        source: the strategy; told to send every weight again when the engine lost its weights.
        watchdog: the controller's :class:`~rltrainer.controller.watchdog.Watchdog`.
        mode: the default push mode (:data:`PUSH_MODES`).
        view: the LoRA view the engine loads (:data:`rltrainer.lora.LORA_VIEWS`; ``None`` without LoRA).
        bucket_bytes: the bucket bound of a push (an export's default shard size too).
    """

    def __init__(self, engine: RolloutEngine, transport: WeightTransport, source: SyncSource, watchdog: Watchdog,
                 mode: str = "wait", view: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        check_push_mode(mode)
        self.engine, self.transport, self.source, self.mode = engine, transport, source, mode
        self.watchdog, self.view, self.bucket_bytes = watchdog, view, bucket_bytes
        self.version = 0  # the version last pushed: the weights the strategy trains (global_step)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | Any | None = None  # a Future (background) or a transport's handle

    def push(self, version: int | None = None, mode: str | None = None) -> dict[str, float]:
        """Push the policy's weights as ``version`` (default: the last pushed, :attr:`version`) in
        ``mode`` (default: this owner's); returns the metrics of whatever push this waited for (with
        ``"wait"``: this one's, ``sync/tensors``, ``sync/bytes``, ``sync/skipped`` (unchanged since
        the last push), ``sync/buckets``...).

        From the moment it returns, requests ask for ``version``: replicas where it has not arrived
        yet wait for it. Once loaded (:meth:`wait`), ``engine.weight_version == version`` (for remote
        replicas in their processes too, even if nothing changed). If a sleep discarded the engine's
        weights (``engine.weights_discarded``), the push sends every weight."""
        mode = self.mode if mode is None else check_push_mode(mode)
        metrics = self.wait()  # one push at a time
        version = self.version = self.version if version is None else version
        if mode == "background":
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rltrainer-weight-sync")
            start, dog = self._start_push, self.watchdog  # the push is watched in its thread
            self._pending = self._executor.submit(dog.call, "weights.push", lambda: start(version).wait())
            return metrics
        self._pending = self.watchdog.call("weights.push", self._start_push, version)
        if mode == "wait":
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

    def close(self) -> None:
        """Wait out a push in flight (its error is not raised: the run is already ending) and stop the thread."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _start_push(self, version: int) -> Any:
        """Hand the changed weights off to the transport (cast to the engine's dtype) as ``version``;
        the engine-side loads are submitted before this returns, so a later ``engine.generate`` runs
        on the new weights. Returns the transport's handle."""
        if getattr(self.engine, "weights_discarded", False):
            self.source.forget_synced()
            self.engine.weights_discarded = False
        handle = self.transport.start(version, on_loaded=self._hold)  # a RemoteEngine mirrors its replicas
        self._hold(version)
        return handle

    def _hold(self, version: int) -> None:
        """Requests from now on ask for ``version`` (set when a push starts and when it has loaded;
        the controller's handle on remote replicas keeps it, see :mod:`rltrainer.weights.versions`)."""
        self.engine.weight_version = version


def check_push_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`PUSH_MODES`, else a ``ValueError`` naming them."""
    if mode not in PUSH_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, PUSH_MODES))}, got {mode!r}")
    return mode
