"""Typed remote methods: a worker's methods the controller calls, marked with :func:`remote`, and
called through a worker group's :attr:`~rltrainer.controller.worker_group.WorkerGroup.remote`.

A worker class declares its remote protocol with ordinary methods (verl's
``@register(dispatch_mode=...)``)::

    class TrainingWorker(Worker):
        @remote(stage="send_weights")
        def plan_weights(self, dtype: torch.dtype | None, only_changed: bool) -> tuple[int, int]: ...

        @remote(RANK_ZERO, stage="send_weights")
        def weight_entries(self) -> list[list[Entry]]: ...

and the controller calls them by name, with arguments checked against the signature before
anything is sent::

    buckets, skipped = group.remote.plan_weights(dtype, True)[0]   # every rank; waits
    entries = group.remote.weight_entries()                        # rank 0; waits
    call = group.remote.export_bucket.start(index)                 # every rank; a RemoteCall
    group.remote.join_weight_group.each([args_rank0, args_rank1])  # rank r gets its own arguments
    device = group.remote.device_type.on_rank_zero()               # a method of every rank, on rank 0

What the decorator declares:

- ``dispatch``: :data:`ALL` (every rank, one result per rank) or :data:`RANK_ZERO` (rank 0 only,
  its result).
- ``stage``: the name the call is waited on as: the watchdog's stage ``<group>.<stage>`` (and its
  timeouts by name, ``stage_timeout_s={"send_weights": ...}``) and the method a
  :class:`~rltrainer.controller.worker_group.WorkerError` names. Default: the method's name.
  The weight-sync methods share ``"send_weights"`` / ``"receive_weights"``, one stage each side.
- ``thread``: the worker's concurrency group (a Ray thread of its own) the method runs in, if the
  worker class has that group (:attr:`Worker.concurrency_groups
  <rltrainer.rollout.worker.Worker.concurrency_groups>`); else the default thread, in order.

This module imports nothing else of ours: the groups use it, the workers are marked with it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

ALL = "all"  # every rank, the same arguments; one result per rank
RANK_ZERO = "rank_zero"  # rank 0 only; its result
DISPATCHES = (ALL, RANK_ZERO)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RemoteSpec:
    """How a remote method is called: see the module docstring."""

    dispatch: str
    stage: str
    thread: str | None


def remote(dispatch: str | F = ALL, *, stage: str | None = None, thread: str | None = None) -> Any:
    """Mark a worker method as called by the controller (see the module docstring); ``@remote``
    alone: every rank, its own name as the stage."""
    if callable(dispatch):  # @remote without arguments
        return remote()(dispatch)
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {', '.join(map(repr, DISPATCHES))}, got {dispatch!r}")

    def mark(fn: F) -> F:
        fn.__rltrainer_remote__ = RemoteSpec(dispatch, stage or fn.__name__, thread)  # type: ignore[attr-defined]
        return fn

    return mark


@functools.lru_cache(maxsize=None)
def remote_methods(worker_cls: type) -> dict[str, RemoteSpec]:
    """The remote methods of ``worker_cls`` (its own and inherited), by name. An override of a
    remote method is remote too, as its base class declared it (unless it declares otherwise)."""
    out: dict[str, RemoteSpec] = {}
    for cls in reversed(worker_cls.__mro__):
        for name, value in vars(cls).items():
            spec = getattr(value, "__rltrainer_remote__", None)
            if isinstance(spec, RemoteSpec):
                out[name] = spec
    return out


def method_threads(worker_cls: type) -> dict[str, str]:
    """The methods of ``worker_cls`` that run in a thread of their own (a concurrency group it has)."""
    groups = getattr(worker_cls, "concurrency_groups", None) or {}
    return {name: spec.thread for name, spec in remote_methods(worker_cls).items()
            if spec.thread is not None and spec.thread in groups}


class RemoteCall:
    """A remote call in flight: its group, its futures (one per rank called) and how to read them.
    :meth:`get` waits (one result per rank, or rank 0's); :attr:`as_call` is the ``(group,
    futures, stage)`` that :func:`~rltrainer.controller.worker_group.get_together` waits for with
    others; :meth:`ref` passes rank 0's result to a call to another group (a Ray ``ObjectRef``)."""

    def __init__(self, group: Any, futures: list[Any], spec: RemoteSpec) -> None:
        self.group, self.futures, self.spec = group, futures, spec

    @property
    def as_call(self) -> tuple[Any, list[Any], str]:
        return self.group, self.futures, self.spec.stage

    def get(self) -> Any:
        results = self.group.get(self.futures, self.spec.stage)
        return results[0] if self.spec.dispatch == RANK_ZERO else results

    def ref(self) -> Any:
        return self.group.ref(self.futures, self.spec.stage)


class BoundRemote:
    """``group.remote.<name>``: call it to run and wait, :meth:`start` to get a :class:`RemoteCall`."""

    def __init__(self, group: Any, name: str, fn: Callable[..., Any], spec: RemoteSpec) -> None:
        self.group, self.name, self.spec = group, name, spec
        self.signature = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.start(*args, **kwargs).get()

    def start(self, *args: Any, **kwargs: Any) -> RemoteCall:
        """Send the call (checked against the method's signature) and return at once."""
        self._check(args, kwargs)
        if self.spec.dispatch == RANK_ZERO:
            futures = self.group._call_async([0], self.name, [(args, kwargs)])
        else:
            futures = self.group._call_async(list(range(self.group.world_size)), self.name,
                                             [(args, kwargs)] * self.group.world_size)
        return RemoteCall(self.group, futures, self.spec)

    def on_rank_zero(self, *args: Any, **kwargs: Any) -> Any:
        """Run a method of every rank on rank 0 only, and wait: its result (e.g. ``device_type``)."""
        self._check(args, kwargs)
        futures = self.group._call_async([0], self.name, [(args, kwargs)])
        return RemoteCall(self.group, futures, RemoteSpec(RANK_ZERO, self.spec.stage, self.spec.thread)).get()

    def each(self, per_rank: Sequence[tuple[Any, ...]]) -> RemoteCall:
        """Rank ``r`` gets the positional arguments ``per_rank[r]`` (one tuple per rank)."""
        if self.spec.dispatch != ALL:
            raise TypeError(f"{self.name}() runs on rank 0 only; per-rank arguments need a method of every rank")
        if len(per_rank) != self.group.world_size:
            raise ValueError(f"{self.name}() needs one argument tuple per rank ({self.group.world_size}), "
                             f"got {len(per_rank)}")
        for args in per_rank:
            self._check(tuple(args), {})
        futures = self.group._call_async(list(range(self.group.world_size)), self.name,
                                         [(tuple(args), {}) for args in per_rank])
        return RemoteCall(self.group, futures, self.spec)

    def _check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.signature.bind(None, *args, **kwargs)  # None: self
        except TypeError as exc:
            params = list(self.signature.parameters.values())[1:]
            shown = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in params)
            raise TypeError(f"{self.name}({shown}): {exc}") from None


class RemoteMethods:
    """``group.remote``: the remote methods of the group's worker class, as attributes."""

    def __init__(self, group: Any, worker_cls: type) -> None:
        self._group, self._cls = group, worker_cls
        self._specs = remote_methods(worker_cls)

    def __getattr__(self, name: str) -> BoundRemote:
        spec = self.__dict__.get("_specs", {}).get(name)
        if spec is None:
            raise AttributeError(f"{self._cls.__name__}.{name} is not a remote method (marked @remote); its remote "
                                 f"methods: {', '.join(sorted(self._specs)) or 'none'}")
        return BoundRemote(self._group, name, getattr(self._cls, name), spec)
