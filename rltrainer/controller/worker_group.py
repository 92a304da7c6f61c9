"""Worker groups: the controller's handle on the processes that do the compute.

Dispatch is explicit and typed: :attr:`WorkerGroup.remote` calls the worker class's methods marked
``@remote`` by name, their arguments checked against their signatures, each with its dispatch
(every rank or rank 0, see :mod:`rltrainer.controller.methods`): ``group.remote.plan_weights(dtype,
True)``. Below it, :meth:`WorkerGroup.execute_all` (same arguments to every rank),
:meth:`WorkerGroup.dispatch` (rank ``r`` gets ``per_rank[r]``, e.g. its data-parallel share of a
batch), :meth:`WorkerGroup.execute_rank_zero`. Each has an ``_async`` twin returning futures that
:meth:`WorkerGroup.get` resolves (:func:`get_together` resolves calls to several groups as one).

:class:`InProcessWorkerGroup` runs one worker in the controller's process (no Ray, breakpoints
work); :class:`RayWorkerGroup` runs ``world_size`` Ray actors in one placement group. Either way,
a worker that raises or dies surfaces in the controller as a :class:`WorkerError` naming the
worker, the method and the remote traceback; the Ray group then kills all its actors, since the
surviving ranks may be blocked in a collective with the failed one. A Ray group given a
:class:`~rltrainer.controller.watchdog.Watchdog` also fails a wait that runs past its stage's
timeout (a hung rank), with the ranks that did not answer and their stacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from rltrainer.controller.errors import WorkerError
from rltrainer.controller.methods import RemoteMethods, method_threads
from rltrainer.controller.reaper import start_reaper
from rltrainer.controller.watchdog import StageTimeout, Watchdog, python_stacks

__all__ = ["InProcessWorkerGroup", "RayWorkerGroup", "WorkerError", "WorkerGroup", "ensure_ray", "get_together"]

log = logging.getLogger(__name__)


class _Done:
    """An in-process 'future': the result or the exception of a call already made."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class WorkerGroup:
    """``world_size`` workers of one class, addressed by rank."""

    name: str = "workers"
    world_size: int = 1
    worker_cls: type = object

    @property
    def remote(self) -> RemoteMethods:
        """The worker class's remote methods (marked ``@remote``), called on this group's ranks:
        ``group.remote.plan_weights(dtype, True)`` (see :mod:`rltrainer.controller.methods`)."""
        return RemoteMethods(self, self.worker_cls)

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.dispatch_async(method, [(args, kwargs)] * self.world_size)

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.get(self.execute_all_async(method, *args, **kwargs), method)

    def dispatch(self, method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        return self.get(self.dispatch_async(method, per_rank), method)

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.get(self.execute_rank_zero_async(method, *args, **kwargs), method)[0]

    def execute_rank_zero_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._call_async([0], method, [(args, kwargs)])

    def dispatch_async(self, method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        if len(per_rank) != self.world_size:
            raise ValueError(f"dispatch of {method}() needs one argument set per rank ({self.world_size}), got {len(per_rank)}")
        return self._call_async(list(range(self.world_size)), method, per_rank)

    def _call_async(self, ranks: list[int], method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        raise NotImplementedError

    def get(self, futures: Sequence[Any], method: str) -> list[Any]:
        raise NotImplementedError

    def ref(self, futures: Sequence[Any], method: str) -> Any:
        """The first call's result as an argument for a call to another group: a Ray ``ObjectRef``
        (Ray resolves it before that call runs, so the call waits for this one), or the value."""
        return self.get(futures[:1], method)[0]

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


class InProcessWorkerGroup(WorkerGroup):
    """One worker, constructed and called in this process."""

    def __init__(self, worker_cls: type, name: str = "workers", **init_kwargs: Any) -> None:
        self.name, self.worker_cls = name, worker_cls
        self.world_size = 1
        self.worker = worker_cls(rank=0, world_size=1, **init_kwargs)

    def _call_async(self, ranks: list[int], method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        args, kwargs = per_rank[0]
        try:
            return [_Done(getattr(self.worker, method)(*args, **kwargs))]
        except Exception as exc:  # re-raised by get(), as Ray would
            return [_Done(error=exc)]

    def get(self, futures: Sequence[Any], method: str) -> list[Any]:
        for f in futures:
            if f.error is not None:
                raise f.error  # same process: the original exception and traceback
        return [f.value for f in futures]

    def shutdown(self) -> None:
        """Release what the worker holds (engine, process group); nothing to kill in-process."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


def get_together(calls: Sequence[tuple[WorkerGroup, Sequence[Any], str]]) -> list[list[Any]]:
    """Wait for the futures of several groups' calls as one (``(group, futures, method)`` each;
    returns each call's results). The first failure raises, as its group's :class:`WorkerError`
    (a worker that died is preferred: it explains its peers' errors), and the other Ray groups are
    shut down: their workers may be blocked in a collective with the failed one (e.g. a weight
    broadcast between two groups)."""
    errors: dict[int, bool] = {}  # call -> whether a worker died (else it raised)
    for i, (group, futures, _) in enumerate(calls):
        if isinstance(group, InProcessWorkerGroup) and any(f.error is not None for f in futures):
            errors[i] = False
    owner = {ref: i for i, (group, futures, _) in enumerate(calls) if isinstance(group, RayWorkerGroup)
             for ref in futures}
    if owner:
        import ray

        until = time.monotonic() + RayWorkerGroup.failure_grace_s if errors else None
        pending = list(owner)
        watch = _watch_together(calls)
        while pending:
            timeout = None if until is None else max(0.0, until - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=watch.wait_s(timeout))
            if not ready and until is None:  # nothing failed: the stage ran past its timeout
                watch.time_out(calls, pending, owner)
            if not ready:
                break
            died = _failure(ready[0])
            if died is not None:
                errors[owner[ready[0]]] = errors.get(owner[ready[0]], False) or died
                if died:
                    break
                until = until or time.monotonic() + RayWorkerGroup.failure_grace_s  # a death may follow
        watch.end(completed=not errors)
    if errors:
        failed = min(errors, key=lambda i: (not errors[i], i))
        group, futures, method = calls[failed]
        try:
            group.get(futures, method)
        except Exception as exc:
            others = [g for i, (g, _, _) in enumerate(calls) if i != failed and isinstance(g, RayWorkerGroup)]
            for other in others:
                other.shutdown()
            if others:
                exc.add_note(f"Worker groups {[g.name for g in others]} were shut down too: they were waiting on "
                             f"{group.name!r} in the same operation.")
            raise
    return [group.get(futures, method) for group, futures, method in calls]


class _WatchedWait:
    """One watched wait of :func:`get_together`: its stage (``group+group.method``) and deadline."""

    def __init__(self, watchdog: Watchdog | None, stage: str) -> None:
        self.watchdog, self.stage = watchdog, stage
        self.call = watchdog.begin(stage) if watchdog is not None else None
        self.timeout_s = _finite(watchdog.timeout_for(stage)) if watchdog is not None else None
        self.start = time.monotonic()

    def wait_s(self, other: float | None) -> float | None:
        """How long the next ``ray.wait`` may block: to the deadline, or ``other`` if sooner."""
        if self.timeout_s is None:
            return other
        left = max(0.0, self.start + self.timeout_s - time.monotonic())
        return left if other is None else min(left, other)

    def end(self, completed: bool) -> None:
        if self.watchdog is not None and self.call is not None:
            self.watchdog.end(self.call, completed)
            self.call = None

    def time_out(self, calls: Sequence[tuple[WorkerGroup, Sequence[Any], str]], pending: list[Any],
                 owner: dict[Any, int]) -> None:
        """Raise the timeout, from the first group with ranks that have not answered, after the
        others are shut down (their ranks wait on those)."""
        self.end(completed=False)
        late: dict[int, list[int]] = {}
        for ref in pending:
            i = owner[ref]
            late.setdefault(i, []).append(list(calls[i][1]).index(ref))
        first = min(late)
        for i, (group, _, _) in enumerate(calls):
            if i != first and isinstance(group, RayWorkerGroup):
                group.shutdown()
        group, _, method = calls[first]
        group._time_out(method, sorted(late[first]), time.monotonic() - self.start, self.timeout_s or 0.0,
                        stage=self.stage)


def _finite(seconds: float) -> float | None:
    """``ray.wait``'s timeout: ``None`` for no limit."""
    return None if seconds == float("inf") else seconds


def _watch_together(calls: Sequence[tuple[WorkerGroup, Sequence[Any], str]]) -> _WatchedWait:
    ray_groups = [g for g, _, _ in calls if isinstance(g, RayWorkerGroup)]
    watchdog = next((g.watchdog for g in ray_groups if g.watchdog is not None), None)
    names = "+".join(dict.fromkeys(g.name for g in ray_groups))
    return _WatchedWait(watchdog, f"{names}.{calls[0][2]}")


def _failure(ref: Any) -> bool | None:
    """None if the call succeeded; True if its worker died; False if it raised."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(ref)
    except RayActorError:
        return True
    except Exception:
        return False
    return None


def ensure_ray(init_kwargs: dict[str, Any] | None = None) -> bool:
    """Connect to Ray (``ray.init``) unless already connected; return True if this call started it. A
    cluster that ``ray.init`` starts gets a watcher that stops its processes if this one dies
    (:mod:`rltrainer.controller.reaper`); stop it with :func:`~rltrainer.controller.reaper.shutdown_ray`."""
    import ray

    if ray.is_initialized():
        return False
    import os

    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    kwargs.update(init_kwargs or {})
    if kwargs.get("address") is None and not os.environ.get("RAY_ADDRESS"):  # a local cluster of our own,
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # for which Ray 2.60 would otherwise want a token
    ray.init(**kwargs)
    node = ray._private.worker._global_node
    if getattr(node, "ray_init_cluster", False):  # processes of ours: none may outlive this one (a SIGKILL)
        start_reaper(node.get_session_dir_path())
    log.info("Started Ray: %s", ray.cluster_resources())
    return True


def _summary(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in ("CPU", "GPU"))


class RayWorkerGroup(WorkerGroup):
    """``world_size`` Ray actors of ``worker_cls``, one per bundle of a placement group. An actor
    runs its calls one at a time, in the order they were sent; a worker class that names
    ``concurrency_groups`` (name: threads) gets those threads too, and its remote methods marked
    with one of them (``@remote(thread=...)``) run there, beside the others (still in order within
    their group).

    A call reaches every rank it names at the same point of each rank's sequence: its per-rank
    submissions are made as one, under a lock, so calls from several controller threads (a
    request and a push's receives, say) cannot interleave between ranks (rank 0 getting
    ``[generate, receive]`` while rank 1 gets ``[receive, generate]``). Ranks that run their calls
    in order and meet in collectives (a training step, a tensor-parallel replica's request) rely on
    it; Ray runs the calls of one caller to one actor in the order they were submitted.

    Args:
        worker_cls: the class to run (constructed with ``rank``, ``world_size`` and ``init_kwargs``).
        world_size: number of actors.
        cpus_per_worker / gpus_per_worker: the resources of each bundle.
        placement: Ray placement strategy: ``"PACK"`` (fill a node first) or ``"SPREAD"``...
        ready_timeout_s: how long to wait for the cluster to grant the resources.
        runtime_env: Ray's ``runtime_env`` for the actors (e.g. another interpreter: ``py_executable``).
        watchdog: fails a wait that runs past its stage's timeout (``None``: waits have no limit).
    """

    failure_grace_s = 3.0  # after a first failure, how long the other ranks get to report theirs

    def __init__(self, worker_cls: type, world_size: int, name: str = "workers", cpus_per_worker: float = 1.0,
                 gpus_per_worker: float = 0.0, placement: str = "PACK", ready_timeout_s: float = 60.0,
                 watchdog: Watchdog | None = None, runtime_env: dict[str, Any] | None = None,
                 **init_kwargs: Any) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self.name, self.world_size, self.watchdog, self.worker_cls = name, world_size, watchdog, worker_cls
        self.method_groups = method_threads(worker_cls)  # method -> its concurrency group
        self.actors: list[Any] = []
        self._submitting = threading.Lock()  # one call's per-rank submissions at a time (see the class docstring)
        self._broken: str | None = None
        self._failure: WorkerError | None = None  # the failure that shut the group down
        bundle = {"CPU": cpus_per_worker} | ({"GPU": gpus_per_worker} if gpus_per_worker else {})
        total = ray.cluster_resources()
        short = {k: v * world_size for k, v in bundle.items() if v * world_size > total.get(k, 0.0)}
        if short:
            raise RuntimeError(
                f"{world_size} {name} workers with {bundle} each need {short}, but the whole Ray cluster has "
                f"{_summary(total)}. Lower devices or cpus_per_worker/gpus_per_worker, or add nodes."
            )
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy=placement)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=ready_timeout_s)
        if not ready:
            available = ray.available_resources()
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"Ray could not place {world_size} {name} workers with {bundle} each within {ready_timeout_s:.0f} s: "
                f"{_summary(available)} free of {_summary(total)} (other workers hold the rest). Lower devices or "
                "cpus_per_worker/gpus_per_worker, start Ray with more logical CPUs (ray.init(num_cpus=...)), "
                "or add nodes."
            )
        self.runtime_env = runtime_env
        self.actors = self._start_actors(worker_cls, cpus_per_worker, gpus_per_worker, init_kwargs)
        self.pids = self.remote.pid()

    def _start_actors(self, worker_cls: type, cpus_per_worker: float, gpus_per_worker: float,
                      init_kwargs: dict[str, Any]) -> list[Any]:
        """One actor per bundle of the placement group, rank ``r`` on bundle ``r`` (a subclass may
        supply the processes otherwise: ``rltrainer.testing.warm_ranks`` reuses warm ones)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        groups = getattr(worker_cls, "concurrency_groups", None)
        remote_cls = ray.remote(concurrency_groups=groups)(worker_cls) if groups else ray.remote(worker_cls)
        actors = []
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker, "scheduling_strategy": strategy,
                       "name": None}
            if self.runtime_env:
                options["runtime_env"] = self.runtime_env
            actors.append(remote_cls.options(**options).remote(rank=rank, world_size=self.world_size, **init_kwargs))
        return actors

    def _call_async(self, ranks: list[int], method: str, per_rank: Sequence[tuple[tuple, dict]]) -> list[Any]:
        if self._failure is not None:  # another thread's call saw it first: report the same failure
            first = self._failure
            raise WorkerError(first.group, first.rank, first.method, f"{first.detail}\n(The group was shut down after "
                              f"this failure, so {method}() could not run.)")
        if self._broken:
            raise RuntimeError(f"Worker group {self.name!r} was shut down after an earlier failure: {self._broken}")
        handles = [getattr(self.actors[r], method) for r in ranks]
        if method in self.method_groups:  # a thread of its own in the actor (Ray concurrency group)
            handles = [h.options(concurrency_group=self.method_groups[method]) for h in handles]
        with self._submitting:  # every rank gets this call between the same two others
            return [h.remote(*a, **kw) for h, (a, kw) in zip(handles, per_rank)]

    def ref(self, futures: Sequence[Any], method: str) -> Any:
        return futures[0]

    def get(self, futures: Sequence[Any], method: str) -> list[Any]:
        """Wait for all futures. A failure raises at once, naming the worker: a dead process is
        reported before the errors it causes in its peers' collectives."""
        import ray

        rank_of = {ref: i for i, ref in enumerate(futures)}  # futures are issued in rank order
        results: list[Any] = [None] * len(futures)
        failures: list[tuple[int, bool, str, BaseException | None]] = []
        pending = list(futures)
        stage = f"{self.name}.{method}"
        call = self.watchdog.begin(stage) if self.watchdog is not None else None
        timeout = _finite(self.watchdog.timeout_for(stage)) if self.watchdog is not None else None
        start = time.monotonic()
        while pending and not failures:
            left = None if timeout is None else max(0.0, start + timeout - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:  # past the stage's timeout
                self.watchdog.end(call, completed=False)
                self._time_out(method, [rank_of[r] for r in pending], time.monotonic() - start, timeout)
            self._collect(ready, rank_of, results, failures)
        if call is not None:
            self.watchdog.end(call, completed=not failures)
        if failures:
            if pending:  # give the other ranks a moment to report (a dead peer fails their collectives)
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.failure_grace_s)
                self._collect(ready, rank_of, results, failures)
            self._fail(method, failures, still_running=[rank_of[r] for r in pending])
        return results

    def _collect(self, ready: list[Any], rank_of: dict[Any, int], results: list[Any],
                 failures: list[tuple[int, bool, str, BaseException | None]]) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        for ref in ready:
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref)
            except RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else None
                failures.append((rank, False, str(exc), cause))
            except RayActorError as exc:
                failures.append((rank, True, f"the worker process died (pid {self._pid(rank)}): {exc}", None))

    def _pid(self, rank: int) -> Any:
        return self.pids[rank] if getattr(self, "pids", None) else "?"

    def _fail(self, method: str, failures: list[tuple[int, bool, str, BaseException | None]],
              still_running: list[int]) -> None:
        failures.sort(key=lambda f: (not f[1], f[0]))  # deaths first: they explain the rest
        rank, _, detail, cause = failures[0]
        others = [f"rank {r}: {'died' if died else d.strip().splitlines()[-1]}" for r, died, d, _ in failures[1:]]
        if others:
            detail += "\nOther ranks in the same call: " + "; ".join(others)
        if still_running:
            detail += f"\nRanks {still_running} were still running (likely blocked in a collective); they are killed."
        error = WorkerError(self.name, rank, method, detail)
        self._broken = str(error).splitlines()[0]
        self._failure = error
        self.shutdown()
        raise error from cause

    def _time_out(self, method: str, ranks: list[int], waited_s: float, timeout_s: float,
                  stage: str | None = None) -> None:
        """Raise :class:`~rltrainer.controller.watchdog.StageTimeout` for ``ranks`` (with their
        stacks), after killing the group: its other ranks may wait on them in a collective."""
        stacks = python_stacks({r: self._pid(r) for r in ranks if isinstance(self._pid(r), int)})
        in_flight = self.watchdog.in_flight() if self.watchdog is not None else []
        error = StageTimeout(self.name, method, ranks, waited_s, timeout_s, stacks, in_flight)
        if stage is not None and stage != error.stage:
            error.add_note(f"The wait was one operation of several groups: stage {stage!r}.")
        log.error("%s", error)
        self._broken = str(error).splitlines()[0]
        self._failure = error
        self.shutdown()
        raise error

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        actors, self.actors = self.actors, []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        if getattr(self, "placement_group", None) is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None
        if not self._broken and actors:
            self._broken = "shut down"
