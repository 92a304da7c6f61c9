"""No silent hangs: the controller's :class:`Watchdog` over its calls to worker processes.

Every wait of a Ray worker group (:meth:`~rltrainer.controller.worker_group.RayWorkerGroup.get`,
:func:`~rltrainer.controller.worker_group.get_together`) is a *stage*, named
``<group>.<method>``: ``actor.train_step`` (the policy update, ``policy_step`` on every rank),
``actor.compute``, ``actor.send_weights``, ``rollout.generate`` (the engine replicas)... The watchdog
knows which stages are in flight and how long each stage took before. A stage that runs past its
timeout raises :class:`StageTimeout` in the controller, naming the stage, the ranks that have not
answered and their Python stacks (``py-spy dump``, where py-spy is installed and the process is on
this node); the group then kills its workers, and the Trainer tears everything else down.

The timeout of a stage: ``timeout_s`` if given (one number for every stage, or a dict by stage
or method name, e.g. ``{"train_step": 600}``; a stage it does not name gets the default). The
default is ``factor`` times the stage's running median (its last ``window`` completed calls), at
least ``floor_s``; before a stage has completed once (its first call compiles, loads, warms up),
``first_timeout_s``.

With ``stage_timeout_s`` set, the controller's own waits are watched too (:meth:`Watchdog.call`,
:meth:`Watchdog.wait_first`): ``reward.reward_step`` (the reward functions, in this process or in a
reward pool), the ``single`` strategy's ``single.compute`` / ``single.train_step``,
``rollout.rollout_step`` and ``rollout.validation_step`` (an engine in this process generating),
``weights.push`` and
``pipeline.wait`` (the trainer waiting for rows from the rollout threads). A call in this process
cannot be killed: it runs in a daemon thread, and past its timeout the controller raises
:class:`StageTimeout` with that thread's Python stack and leaves the thread behind (it does not keep
the interpreter alive at exit); what can be stopped is stopped (a reward pool is killed). While
another watched wait is in flight (inside this one, e.g. a push waiting on its Ray workers, or the
work this one waits for in another thread), that one reports first: it knows more. Without
``stage_timeout_s``, only the waits on worker processes are watched (with the defaults above); a
debugger or ``py-spy dump`` on the controller shows the rest.
"""

from __future__ import annotations

import contextvars
import difflib
import itertools
import logging
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, TypeVar

from rltrainer.controller.errors import WorkerError
from rltrainer.values import check_float

log = logging.getLogger(__name__)
T = TypeVar("T")
INNER_GRACE_S = 30.0  # past its own deadline, an outer wait gives an inner watched wait this long to report

#: The groups a stage (``<group>.<method>``) belongs to: the training ranks, the engine replicas, and the
#: controller's own waits (a wait on both worker groups at once is ``actor+rollout.<method>``).
STAGE_GROUPS = ("actor", "rollout", "reward", "single", "weights", "pipeline")
#: The controller's own stages (watched with ``stage_timeout_s`` set).
CONTROLLER_STAGES = ("reward.reward_step", "rollout.rollout_step", "rollout.validation_step", "single.compute",
                     "single.train_step", "weights.push", "pipeline.wait")
#: The worker methods the controller waits on, by their stage name (``@remote(stage=...)``; the
#: test of this module holds the list to the workers' own).
WORKER_METHODS = (
    "checkpoint_digests", "compute", "destroy_distributed", "device_type", "engine_sleep", "engine_teardown",
    "engine_wake_up", "engine_weight_digests", "engine_weight_groups", "engine_weight_version", "engine_weights",
    "forget_synced", "generate", "init_distributed", "load_checkpoint", "load_state_dict", "master_address",
    "model_config", "node_ip", "pid", "prompt_log_probs", "python", "receive_weights", "release_weights", "rng_state",
    "save_checkpoint", "seed_rng", "send_weights", "set_rng_state", "set_weight_groups", "set_weight_view", "setup",
    "setup_engine", "state_dict", "train_step", "use_shared_memory", "verify_checkpoint", "wait_checkpoint",
    "weight_names")


def stage_names() -> list[str]:
    """Every name ``stage_timeout_s`` may key a timeout by: the groups, the methods, the stages."""
    methods = sorted({*WORKER_METHODS, *(s.split(".", 1)[1] for s in CONTROLLER_STAGES)})
    return [*STAGE_GROUPS, *methods, *CONTROLLER_STAGES]


def check_stage_names(timeouts: Mapping[str, Any]) -> None:
    """Raise for a key of ``stage_timeout_s`` that names no stage, method or group (``"rewrad"``):
    its timeout would never apply, and the stage would keep its default."""
    known = stage_names()
    methods = set(known) - set(STAGE_GROUPS) - set(CONTROLLER_STAGES)

    def names_a_stage(key: str) -> bool:
        group, _, method = key.partition(".")
        return key in known or (all(g in STAGE_GROUPS for g in group.split("+")) and (not method or method in methods))

    unknown = [key for key in timeouts if not isinstance(key, str) or not names_a_stage(key)]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Trainer(stage_timeout_s={dict(timeouts)!r}): {unknown[0]!r} names no stage, so its timeout would never "
            f"apply.{hint} A key is a group ({', '.join(STAGE_GROUPS)}), a method ({', '.join(sorted(methods))}) or a "
            f"stage, group.method (the controller's own: {', '.join(CONTROLLER_STAGES)}); e.g. "
            "stage_timeout_s={'reward_step': 60, 'train_step': 900}.")


class StageTimeout(WorkerError):
    """A stage ran past its timeout: ``stage``, ``ranks`` (those that had not answered), ``hung``
    (those of them not waiting for a peer in a collective: the ones to look at), ``waited_s``,
    ``timeout_s`` and ``stacks`` (rank -> Python stack, or why there is none). A call in the
    controller's own process has no ranks: ``stacks`` holds its thread's stack under rank ``-1``."""

    def __init__(self, group: str, method: str, ranks: Sequence[int], waited_s: float, timeout_s: float,
                 stacks: Mapping[int, str], in_flight: Sequence[str] = (), who: str | None = None) -> None:
        self.stage, self.ranks, self.waited_s, self.timeout_s = f"{group}.{method}", list(ranks), waited_s, timeout_s
        self.stacks = dict(stacks)
        waiting = [r for r in self.ranks if _in_collective(self.stacks.get(r, ""))]
        self.hung = [r for r in self.ranks if r not in waiting] or list(self.ranks)
        if who is None:
            who = f"{_ranks(self.hung)} of {group!r} did not answer"
            if waiting and self.hung != self.ranks:
                who += f" ({_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} for it in a collective)"
        headline = f"Stage {self.stage!r} timed out after {waited_s:.0f} s (its timeout: {timeout_s:.0f} s): {who}."
        lines = ["Everything is shut down. If the stage is only slow, raise its timeout: Trainer(stage_timeout_s={"
                 + repr(method) + ": seconds}) (or one number for every stage)."]
        if in_flight:
            lines.append("Other stages in flight: " + "; ".join(in_flight))
        for rank in self.ranks or sorted(self.stacks):
            where = f"rank {rank}" if rank >= 0 else "the controller's thread"
            lines.append(f"--- {where}: Python stack ---\n{self.stacks.get(rank, '(not obtained)').rstrip()}")
        super().__init__(group, self.hung[0] if self.hung else -1, method, "\n".join(lines), headline)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _in_collective(stack: str) -> bool:
    """Whether a rank's stack shows it waiting in torch.distributed (on a peer), not hung itself."""
    return "torch/distributed/" in stack.replace("\\", "/")


class Watchdog:
    """Timeouts for the controller's waits on its worker groups (see the module docstring).

    Args:
        timeout_s: a fixed timeout in seconds for every stage, a dict ``{stage or method: seconds}``
            for some (the others: the default), or ``None`` (the default for all).
        factor: the default timeout is ``factor`` x the stage's running median...
        floor_s: ...and at least this.
        first_timeout_s: a stage that has not completed yet (its first call).
        window: completed calls per stage the median is taken over.
    """

    def __init__(self, timeout_s: float | Mapping[str, float] | None = None, factor: float = 10.0,
                 floor_s: float = 300.0, first_timeout_s: float = 1800.0, window: int = 20) -> None:
        if isinstance(timeout_s, Mapping):
            check_stage_names(timeout_s)
        for key, value in (timeout_s.items() if isinstance(timeout_s, Mapping) else [(None, timeout_s)]):
            check_float("stage_timeout_s" + (f"[{key!r}]" if key is not None else ""), value, above=0, finite=False,
                        none="the default: 10x the stage's median, >= 300 s" if key is None else None, owner="Trainer",
                        meaning="seconds; math.inf: no limit; or a dict of them by stage, method or group name")
        if factor <= 0 or floor_s <= 0 or first_timeout_s <= 0:
            raise ValueError(f"factor, floor_s and first_timeout_s must be positive, got {factor}, {floor_s}, "
                             f"{first_timeout_s}")
        self.timeout_s, self.factor, self.floor_s, self.first_timeout_s = timeout_s, factor, floor_s, first_timeout_s
        self.window = window
        self._durations: dict[str, deque[float]] = {}
        self._in_flight: dict[int, tuple[str, float]] = {}  # call id -> (stage, start)
        self._deadlines: dict[int, float] = {}  # call id -> when it times out (time.monotonic)
        self._reporting: dict[int, float] = {}  # a failed call -> until when it may still be reporting
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def timeout_for(self, stage: str) -> float:
        """Seconds ``stage`` (``group.method``) may take now."""
        method, group = stage.rsplit(".", 1)[-1], stage.split(".", 1)[0]
        if isinstance(self.timeout_s, Mapping):
            fixed = next((self.timeout_s[k] for k in (stage, method, group) if k in self.timeout_s), None)
            if fixed is not None:
                return float(fixed)
        elif self.timeout_s is not None:
            return float(self.timeout_s)
        with self._lock:
            durations = list(self._durations.get(stage, ()))
        if not durations:
            return self.first_timeout_s
        return max(self.floor_s, self.factor * statistics.median(durations))

    def begin(self, stage: str) -> int:
        """A call of ``stage`` starts (its wait, in the controller); returns its id for :meth:`end`."""
        timeout = self.timeout_for(stage)
        with self._lock:
            call = next(self._ids)
            now = time.monotonic()
            self._in_flight[call] = (stage, now)
            self._deadlines[call] = now + timeout
        return call

    def others_deadline(self, call: int) -> float:
        """Until when another call may still report an error: the latest deadline (plus a grace to
        report) of the other calls in flight (maybe a wait inside ``call``, e.g. on the Ray workers a
        push goes to, or the work ``call`` waits for in another thread), and the grace of those that
        just failed (reporting now: stacks, shutdown); ``-inf`` if none."""
        now = time.monotonic()
        with self._lock:
            self._reporting = {c: t for c, t in self._reporting.items() if t > now}
            ends = [d + INNER_GRACE_S for c, d in self._deadlines.items() if c != call]
            return max(ends + list(self._reporting.values()), default=float("-inf"))

    def end(self, call: int, completed: bool = True) -> None:
        """The call ended; a completed call's duration joins its stage's median."""
        with self._lock:
            stage, start = self._in_flight.pop(call, (None, 0.0))
            self._deadlines.pop(call, None)
            if stage is not None and not completed:  # it reports its error now: outer waits let it
                self._reporting[call] = time.monotonic() + INNER_GRACE_S
            if stage is not None and completed:
                self._durations.setdefault(stage, deque(maxlen=self.window)).append(time.monotonic() - start)

    def in_flight(self, exclude: int | None = None) -> list[str]:
        """The stages in flight now, as ``"rollout.generate for 12 s"``."""
        now = time.monotonic()
        with self._lock:
            return [f"{stage} for {now - start:.0f} s" for call, (stage, start) in self._in_flight.items()
                    if call != exclude]


    # -- waits in the controller's own process -------------------------------------------------------
    @property
    def watches_in_process(self) -> bool:
        """Whether the controller's own waits are watched (``stage_timeout_s`` was set)."""
        return self.timeout_s is not None

    def call(self, stage: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` under ``stage``'s timeout, in a daemon thread with this thread's
        context (context variables, grad mode, CUDA device); its result, or what it raised. Past the
        timeout: :class:`StageTimeout` with the thread's stack, after stopping what the call declared
        (:func:`doing`); the thread is left behind. Unwatched (no ``stage_timeout_s``), or already
        inside a watched call of this stage: a plain call."""
        if not self.watches_in_process or (_CURRENT.get() is not None and _CURRENT.get().stage == stage):
            return fn(*args, **kwargs)
        import torch

        current = _Current(stage)
        outcome: dict[str, Any] = {}
        grad = torch.is_grad_enabled()
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run() -> None:
            _CURRENT.set(current)
            if device is not None:
                torch.cuda.set_device(device)
            try:
                with torch.set_grad_enabled(grad):
                    outcome["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # raised again in the caller
                outcome["error"] = exc

        future: Future = Future()
        thread = threading.Thread(target=_finish, args=(contextvars.copy_context(), run, future), daemon=True,
                                  name=f"rltrainer-{stage}")
        thread.start()
        self.wait_first(stage, [future], threads=[thread], current=current)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def result(self, stage: str, pending: Future | Any) -> Any:
        """A ``Future``'s result (its work is watched where it runs), or ``pending.wait()`` (a
        weight push's handle) under ``stage``'s timeout."""
        return pending.result() if isinstance(pending, Future) else self.call(stage, pending.wait)

    def wait_first(self, stage: str, futures: Sequence[Future], threads: Sequence[threading.Thread] | str = (),
                   current: _Current | None = None) -> set[Future]:
        """Wait until one of ``futures`` is done (``concurrent.futures.wait``, ``FIRST_COMPLETED``);
        return the done ones. Watched, past ``stage``'s timeout: :class:`StageTimeout` with the
        stacks of ``threads`` (or of the threads whose name starts with it), the ones doing the work."""
        if not self.watches_in_process:
            return wait(futures, return_when=FIRST_COMPLETED).done
        call = self.begin(stage)
        start, timeout = time.monotonic(), self.timeout_for(stage)
        deadline = start + timeout
        while True:
            done = wait(futures, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED).done
            if done:
                self.end(call)
                return done
            # another watched wait in flight (inside this one, or the work it waits for) reports first:
            # it knows more (the ranks); it gets until its own deadline plus a grace, within a bound
            now, later = time.monotonic(), min(self.others_deadline(call), start + 2 * timeout + INNER_GRACE_S)
            if later <= now:
                break
            deadline = min(later, now + 0.5)  # and look again soon: it may end before
        self.end(call, completed=False)
        if isinstance(threads, str):
            threads = [t for t in threading.enumerate() if t.name.startswith(threads)]
        stopped = _stop(current)
        group, method = stage.rsplit(".", 1) if "." in stage else ("controller", stage)
        where = "".join(f" (in {w})" for w in map(_where, threads[:1]) if w)
        who = (f"{stopped or 'the call'} did not return{where} in the controller's thread "
               f"{', '.join(repr(t.name) for t in threads) or '(none running)'}")
        stacks = {-1 - i: _thread_stack(t) for i, t in enumerate(threads)}
        error = StageTimeout(group, method, [], time.monotonic() - start, self.timeout_for(stage), stacks,
                             self.in_flight(), who=who)
        error.add_note("A call in the controller's process cannot be killed: its thread is left behind (a daemon, "
                       "it does not keep the process alive).")
        log.error("%s", error)
        raise error


class _Current:
    """The watched call this thread runs in: what it is doing (:func:`doing`), how to stop it."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.doing: list[tuple[str, Callable[[], Any] | None]] = []


_CURRENT: contextvars.ContextVar[_Current | None] = contextvars.ContextVar("rltrainer_watched_call", default=None)


@contextmanager
def doing(what: str, stop: Callable[[], Any] | None = None) -> Iterator[None]:
    """Inside a watched call (:meth:`Watchdog.call`): say what runs now (``"reward function 'f'"``:
    a timeout's headline names it) and how to stop it if the stage times out (``pool.close``).
    Elsewhere: nothing."""
    current = _CURRENT.get()
    entry = (what, stop)
    if current is not None:
        current.doing.append(entry)
    try:
        yield
    finally:
        if current is not None:
            current.doing.remove(entry)


def _stop(current: _Current | None) -> str:
    """Stop what a timed-out call declared it was doing; return its description."""
    if current is None:
        return ""
    for what, stop in list(current.doing):
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - reporting the timeout matters more
                log.exception("Could not stop %s after its timeout", what)
    return "; ".join(what for what, _ in current.doing)


def _finish(context: contextvars.Context, run: Callable[[], None], future: Future) -> None:
    try:
        context.run(run)
    finally:
        future.set_result(None)


def _where(thread: threading.Thread) -> str:
    """The innermost frame of ``thread`` outside the standard library: ``"fn (file.py:12)"``."""
    import os
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None and frame.f_code.co_filename.startswith(stdlib):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def _thread_stack(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return f"(thread {thread.name!r} has ended)"
    return f"thread {thread.name!r}:\n" + "".join(traceback.format_stack(frame))


def python_stacks(pids: Mapping[int, int], timeout_s: float = 20.0) -> dict[int, str]:
    """rank -> the Python stack of process ``pids[rank]`` (``py-spy dump``, run for all at once), or
    the reason there is none."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return {rank: "py-spy is not installed (pip install py-spy), so no stack; `ray stack` on the worker's "
                      f"node shows it (pid {pid})" for rank, pid in pids.items()}

    def dump(pid: int) -> str:
        try:
            out = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"py-spy dump --pid {pid} did not answer within {timeout_s:.0f} s"
        return out.stdout if out.returncode == 0 else (f"py-spy dump --pid {pid} failed (the process may be on "
                                                       f"another node): {out.stderr.strip()}")

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(pids)))) as pool:
        return dict(zip(pids, pool.map(dump, pids.values())))
