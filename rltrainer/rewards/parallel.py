"""Running slow reward functions in parallel: a process pool for CPU-bound ones (math-verify,
sandboxed code) and concurrency for ``async def`` ones (a remote judge), each sample under a
timeout. Every call scores one sample; what it returns, or the exception it raised (a timeout is a
:class:`RewardTimeout`), comes back per sample, for :class:`~rltrainer.rewards.RewardManager` to
check and count."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import multiprocessing
import multiprocessing.context
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class RewardTimeout(TimeoutError):
    """A reward function ran past its per-sample ``timeout``; the sample scores 0 (a reward error)."""


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (a function or a callable object) is an ``async def``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def sample_fields(columns: dict[str, list[Any]], i: int) -> dict[str, list[Any]]:
    """Sample ``i``'s fields, each as a one-element list (the call contract of a reward function)."""
    return {key: [values[i]] for key, values in columns.items()}


# -- async functions ---------------------------------------------------------------------------------
def run_async(fn: Callable[..., Any], completions: list[str], columns: dict[str, list[Any]],
              timeout: float | None, max_concurrency: int) -> list[Any]:
    """Await ``fn([completion], **fields)`` for every sample, at most ``max_concurrency`` at once,
    each within ``timeout`` seconds. Runs its own event loop (in a helper thread when this thread
    already runs one, e.g. in a notebook)."""
    async def one(i: int, gate: asyncio.Semaphore) -> Any:
        async with gate:
            try:
                return await asyncio.wait_for(fn([completions[i]], **sample_fields(columns, i)), timeout)
            except asyncio.TimeoutError:
                return RewardTimeout(f"no result within {timeout} s")
            except Exception as error:  # noqa: BLE001 - user code; the sample scores 0
                return error

    async def all_samples() -> list[Any]:
        gate = asyncio.Semaphore(max_concurrency)
        return list(await asyncio.gather(*(one(i, gate) for i in range(len(completions)))))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(all_samples())
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, all_samples()).result()


# -- CPU-bound functions: a process pool ------------------------------------------------------------
def _score_in_worker(payload: bytes, sample: bytes, timeout: float | None) -> bytes:
    """In a pool process: the function on one sample (both pickled by value, and the outcome too:
    a worker has not imported the user's script, whose classes they may hold), interrupted by
    SIGALRM after ``timeout`` seconds (the pool runs tasks in the process's main thread)."""
    from ray import cloudpickle

    fn = cloudpickle.loads(payload)
    completion, fields = cloudpickle.loads(sample)

    def expire(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"no result within {timeout} s")

    if timeout:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        outcome = fn([completion], **fields)
    except Exception as error:  # noqa: BLE001 - user code: sent back as the sample's outcome
        outcome = error
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    try:
        return cloudpickle.dumps(outcome)
    except Exception as error:  # noqa: BLE001 - an outcome that cannot travel is the sample's error
        return cloudpickle.dumps(TypeError(f"the reward function's result {outcome!r} cannot be pickled: {error}"))


def _start_worker() -> None:
    """A pool worker ignores SIGINT: a Ctrl-C in the terminal reaches the whole process group, and the
    controller finishes the step (with these workers) before it stops (:mod:`rltrainer.interrupt`).
    And it ends with the controller, even one killed with SIGKILL (a thread waits on the pipe that
    closes when the controller's process ends)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), name="rltrainer-reward-parent",
                         daemon=True).start()


def _exit_with(sentinel: int) -> None:
    """End this process as soon as ``sentinel`` (the parent process's) reports the parent gone."""
    import multiprocessing.connection
    import os

    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _ready() -> None:
    """A pool worker's first task: import what scoring needs, and hold the worker a moment so
    that the other first tasks start the other workers."""
    import time

    from ray import cloudpickle  # noqa: F401

    time.sleep(0.2)


def _by_value(fn: Callable[..., Any]) -> None:
    """Send the code of ``fn``'s module by value when the workers could not import it (a script's,
    a notebook's or a test's module, not an installed package)."""
    from ray import cloudpickle

    name = getattr(fn, "__module__", None) or type(fn).__module__
    source = sys.modules.get(name)
    path = str(getattr(source, "__file__", "") or "")
    if source is None or name == "__main__" or name.split(".")[0] in ("rltrainer", "builtins"):
        return
    if path and "site-packages" not in path and "dist-packages" not in path:
        cloudpickle.register_pickle_by_value(source)


# -- starting workers without re-running the user's script -------------------------------------------
_LAUNCH = threading.Lock()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """While a worker process starts, the main module shows no file and no spec, as an interactive
    session's would: multiprocessing's ``spawn`` then starts the worker without importing the user's
    script (``_fixup_main_from_path``), which a script without ``if __name__ == "__main__":`` (a
    training script as the README writes it) would run again in every worker, training included. The
    functions travel by value (cloudpickle), so the workers need nothing from it."""
    main = sys.modules.get("__main__")
    with _LAUNCH:
        if main is None:
            yield
            return
        saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned pool worker started with the main module hidden (:func:`_main_hidden`)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        with _main_hidden():  # the preparation data is pickled to the child before this returns
            return multiprocessing.context.SpawnProcess._Popen(process_obj)


class _WorkerContext(multiprocessing.context.SpawnContext):
    """The ``spawn`` start method, for the reward pool's workers (:class:`_WorkerProcess`)."""

    Process = _WorkerProcess


class RewardPool:
    """``num_workers`` spawned processes scoring samples of synchronous reward functions. They start
    without importing the user's script (so one without a ``__main__`` guard is not run again in each).

    A sample that overruns ``timeout`` is interrupted in its worker (SIGALRM); a worker stuck where
    the signal cannot reach (a long C call) is caught by a bound on the whole batch, after which
    the pool is replaced and the samples still out count as timeouts."""

    def __init__(self, num_workers: int, timeout: float | None) -> None:
        self.num_workers, self.timeout = num_workers, timeout
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], completions: list[str],
               columns: dict[str, list[Any]]) -> list[concurrent.futures.Future]:
        """Start scoring every sample; :meth:`collect` waits for them."""
        from ray import cloudpickle

        _by_value(fn)
        payload = cloudpickle.dumps(fn)
        pool = self._executor()
        return [pool.submit(_score_in_worker, payload, cloudpickle.dumps((c, sample_fields(columns, i))), self.timeout)
                for i, c in enumerate(completions)]

    def collect(self, futures: Sequence[concurrent.futures.Future], queued: int) -> list[Any]:
        """Each sample's outcome; ``queued``: tasks submitted before these (they share the workers)."""
        bound = None
        if self.timeout:
            rounds = math.ceil((queued + len(futures)) / self.num_workers)
            bound = self.timeout * rounds + 5.0  # every round at its worst, plus start-up
        from ray import cloudpickle

        done, _ = concurrent.futures.wait(futures, timeout=bound)
        outcomes = []
        for future in futures:
            if future in done:
                error = future.exception()
                outcomes.append(error if error is not None else cloudpickle.loads(future.result()))
            else:
                outcomes.append(RewardTimeout(f"no result within the batch bound of {bound:.0f} s"))
        if len(done) < len(futures):
            self.close()  # a stuck worker: start fresh next time
        return outcomes

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(  # Ctrl-C is the controller's to handle
                self.num_workers, mp_context=_WorkerContext(), initializer=_start_worker)
            # start every worker and import this package there once, outside any timeout
            concurrent.futures.wait([self._pool.submit(_ready) for _ in range(self.num_workers)])
        return self._pool

    def close(self) -> None:
        """Stop the workers (a stuck one is killed)."""
        if self._pool is not None:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "timeout": self.timeout, "_pool": None}
