"""Warm rank processes for tests: worker groups that reuse Ray processes instead of starting new ones.

A multi-process strategy's setup starts one Ray actor per rank; on a small CPU machine most of a
test's time is that start (a fresh Python importing torch and transformers) and the first
``import megatron``. :func:`reuse_rank_processes` makes every worker group a strategy starts a
:class:`WarmWorkerGroup`: its ranks are :class:`RankHost` actors from a :class:`HostPool`, each
holding the group's worker object (any worker class) for the group's life. The group still
reserves its placement group (the same resources, the same errors on a small cluster) and calls
its ranks' methods by name as a :class:`~rltrainer.controller.worker_group.RayWorkerGroup` does.

A group shut down with no call in flight (after a clean run, or a failure every rank has answered)
closes each worker (its process groups, megatron-core's parallel state, its engine) and returns the
host to the pool; one with a call in flight (a hung or blocked rank, a timeout) kills its hosts, as a
plain group kills its actors, and so does a host that died or whose worker does not close.

Only for tests on one CPU node: GPU groups and groups on a Ray cluster the pool did not start in
get plain actors.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

from rltrainer.controller.worker_group import RayWorkerGroup
from rltrainer.rollout.worker import Worker
from rltrainer.strategies import dispatch

#: The Ray concurrency groups every host is created with: those of a split rollout worker.
HOST_GROUPS: dict[str, int] = dict(Worker.concurrency_groups)

#: Seconds a shutting-down group waits for its calls still running before it kills their hosts.
SHUTDOWN_GRACE_S = 2.0

log = logging.getLogger(__name__)


class RankHost:
    """A Ray actor that holds one worker object at a time, of whatever class its group names."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.error: BaseException | None = None

    def start(self, worker_cls: type, rank: int, world_size: int, init_kwargs: dict[str, Any]) -> None:
        """Construct the worker; a constructor that raises fails the group's first call, as an actor
        whose ``__init__`` raised would."""
        self.worker, self.error = None, None
        try:
            self.worker = worker_cls(rank=rank, world_size=world_size, **init_kwargs)
        except Exception as exc:
            self.error = exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.error is not None:
            raise RuntimeError(f"the worker's constructor raised: {self.error!r}") from self.error
        return getattr(self.worker, method)(*args, **kwargs)

    def release(self) -> int:
        """Close the worker (a training rank's ``close``; a rollout worker's engine and process
        group) and drop it; returns this process's id."""
        worker, self.worker, self.error = self.worker, None, None
        if hasattr(worker, "close"):
            worker.close()
        elif worker is not None:
            worker.engine_teardown()
            worker.destroy_distributed()
        del worker
        gc.collect()
        return os.getpid()


class _Method:
    """``handle.method`` of a hosted worker: ``.remote(...)`` calls it through the host
    (``.options(concurrency_group=...)``: in that thread of the host)."""

    def __init__(self, host: Any, method: str, concurrency_group: str | None = None) -> None:
        self.host, self.method, self.concurrency_group = host, method, concurrency_group

    def options(self, concurrency_group: str) -> _Method:
        return _Method(self.host, self.method, concurrency_group)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        call = self.host.call
        if self.concurrency_group is not None:
            call = call.options(concurrency_group=self.concurrency_group)
        return call.remote(self.method, *args, **kwargs)


class HostedActor:
    """Stands for a worker actor in :attr:`RayWorkerGroup.actors`: ``actor.method.remote(...)``."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):  # copy/pickle probes; a worker's remote methods are public
            raise AttributeError(method)
        return _Method(self.host, method)


class HostPool:
    """Idle :class:`RankHost` actors of one Ray session, started on demand. Every host has the
    threads a rollout worker receives weights in (:data:`HOST_GROUPS`); a worker class that names
    none (a training rank) sends every call to the default thread, so it runs them in order."""

    def __init__(self) -> None:
        import ray

        self.session = ray.get_runtime_context().get_job_id()
        self.idle: list[Any] = []
        self.started = 0

    def take(self, count: int, concurrency_groups: dict[str, int] | None = None) -> list[Any]:
        import ray

        missing = {k: v for k, v in (concurrency_groups or {}).items() if HOST_GROUPS.get(k, 0) < v}
        if missing:
            raise ValueError(f"Warm rank hosts have the concurrency groups {HOST_GROUPS}; the worker class needs "
                             f"{missing} too (add them to rltrainer.testing.warm_ranks.HOST_GROUPS)")
        remote_cls = ray.remote(concurrency_groups=dict(HOST_GROUPS))(RankHost)
        while len(self.idle) < count:  # a host reserves no CPU: its group's placement group does
            self.idle.append(remote_cls.options(num_cpus=0).remote())
            self.started += 1
        taken, self.idle = self.idle[:count], self.idle[count:]
        return taken

    def give_back(self, hosts: list[Any]) -> None:
        """Close the hosts' workers and keep the hosts; one whose worker does not close is killed."""
        import ray

        releases = [host.release.remote() for host in hosts]
        for host, release in zip(hosts, releases):
            try:
                ray.get(release, timeout=60)
                self.idle.append(host)
            except Exception as exc:  # it died, or its worker's close raised or hung
                log.info("A warm rank host did not close its worker (%r); killing it", exc)
                kill(host)

    def usable(self) -> bool:
        """Whether the Ray session that started the pool is still the one running."""
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_job_id() == self.session


def kill(host: Any) -> None:
    import ray

    try:
        ray.kill(host, no_restart=True)
    except Exception:  # already dead
        pass


class WarmWorkerGroup(RayWorkerGroup):
    """A :class:`RayWorkerGroup` whose ranks are hosts from :attr:`pool` (see the module docstring)."""

    pool: HostPool | None = None

    def _start_actors(self, worker_cls: type, cpus_per_worker: float, gpus_per_worker: float,
                      init_kwargs: dict[str, Any]) -> list[Any]:
        self.hosts: list[Any] = []
        if gpus_per_worker or self.runtime_env:  # warm processes run this environment: start those afresh
            return super()._start_actors(worker_cls, cpus_per_worker, gpus_per_worker, init_kwargs)
        pool = type(self).pool
        if pool is None or not pool.usable():  # the first group of this Ray session
            pool = type(self).pool = HostPool()
        self.hosts = pool.take(self.world_size, getattr(worker_cls, "concurrency_groups", None))
        self.issued = [host.start.remote(worker_cls, rank, self.world_size, init_kwargs)
                       for rank, host in enumerate(self.hosts)]
        return [HostedActor(host) for host in self.hosts]

    def _call_async(self, ranks: list[int], method: str, per_rank: Any) -> list[Any]:
        futures = super()._call_async(ranks, method, per_rank)
        if getattr(self, "hosts", None):
            self.issued = [*self._in_flight(), *futures]
        return futures

    def _in_flight(self, grace_s: float = 0.0) -> list[Any]:
        """The calls issued to the hosts that have not finished (within ``grace_s`` seconds)."""
        import ray

        if not self.issued:
            return []
        _, pending = ray.wait(self.issued, num_returns=len(self.issued), timeout=grace_s)
        return pending

    def shutdown(self) -> None:
        hosts, self.hosts = getattr(self, "hosts", []), []
        if hosts:
            self.actors = []  # the base class kills actors; hosts go back to the pool or are killed here
            pool = type(self).pool
            # a rank may be blocked in a collective; one whose call is just finishing (its failure not yet
            # reported when another rank's was) gets SHUTDOWN_GRACE_S to answer
            if self._in_flight(SHUTDOWN_GRACE_S) or pool is None or not pool.usable():
                for host in hosts:
                    kill(host)
            else:
                pool.give_back(hosts)
            self.issued = []
            self._broken = self._broken or "shut down"
        super().shutdown()


@contextlib.contextmanager
def reuse_rank_processes() -> Iterator[type[WarmWorkerGroup]]:
    """While open, the worker groups strategies start reuse warm Ray processes (of the Ray session
    running when a group starts: the pool is made then, and again after Ray restarts). The hosts
    outlive the block, for the next one, until Ray shuts down."""
    before, dispatch.RayWorkerGroup = dispatch.RayWorkerGroup, WarmWorkerGroup
    try:
        yield WarmWorkerGroup
    finally:
        dispatch.RayWorkerGroup = before
