"""Running slow reward functions in parallel: a process pool for CPU-bound ones (math-verify,
sandboxed code) and concurrency for ``async def`` ones (a remote judge), each sample under a
timeout. Every call scores one sample; what it returns, or the exception it raised (a timeout is a
:class:`RewardTimeout`), comes back per sample, for :class:`~rltrainer.rewards.RewardManager` to
check and count."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import signal
from collections.abc import Callable, Sequence
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
def _score_in_worker(payload: bytes, completion: str, fields: dict[str, list[Any]], timeout: float | None) -> Any:
    """In a pool process: the function (pickled by value) on one sample, interrupted by SIGALRM
    after ``timeout`` seconds (the pool runs tasks in the process's main thread)."""
    from ray import cloudpickle

    fn = cloudpickle.loads(payload)

    def expire(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"no result within {timeout} s")

    if timeout:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn([completion], **fields)
    except Exception as error:  # noqa: BLE001 - user code: sent back as the sample's outcome
        return error
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _ignore_sigint() -> None:
    """A pool worker ignores SIGINT: a Ctrl-C in the terminal reaches the whole process group, and the
    controller finishes the step (with these workers) before it stops (:mod:`rltrainer.interrupt`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ready() -> None:
    """A pool worker's first task: import what scoring needs, and hold the worker a moment so
    that the other first tasks start the other workers."""
    import time

    from ray import cloudpickle  # noqa: F401

    time.sleep(0.2)


def _by_value(fn: Callable[..., Any]) -> None:
    """Send the code of ``fn``'s module by value when the workers could not import it (a script's,
    a notebook's or a test's module, not an installed package)."""
    import sys

    from ray import cloudpickle

    name = getattr(fn, "__module__", None) or type(fn).__module__
    source = sys.modules.get(name)
    path = str(getattr(source, "__file__", "") or "")
    if source is None or name == "__main__" or name.split(".")[0] in ("rltrainer", "builtins"):
        return
    if path and "site-packages" not in path and "dist-packages" not in path:
        cloudpickle.register_pickle_by_value(source)


class RewardPool:
    """``num_workers`` spawned processes scoring samples of synchronous reward functions.

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
        return [pool.submit(_score_in_worker, payload, c, sample_fields(columns, i), self.timeout)
                for i, c in enumerate(completions)]

    def collect(self, futures: Sequence[concurrent.futures.Future], queued: int) -> list[Any]:
        """Each sample's outcome; ``queued``: tasks submitted before these (they share the workers)."""
        bound = None
        if self.timeout:
            rounds = math.ceil((queued + len(futures)) / self.num_workers)
            bound = self.timeout * rounds + 5.0  # every round at its worst, plus start-up
        done, _ = concurrent.futures.wait(futures, timeout=bound)
        outcomes = []
        for future in futures:
            if future in done:
                error = future.exception()
                outcomes.append(error if error is not None else future.result())
            else:
                outcomes.append(RewardTimeout(f"no result within the batch bound of {bound:.0f} s"))
        if len(done) < len(futures):
            self.close()  # a stuck worker: start fresh next time
        return outcomes

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing

            self._pool = concurrent.futures.ProcessPoolExecutor(  # Ctrl-C is the controller's to handle
                self.num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_sigint)
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
