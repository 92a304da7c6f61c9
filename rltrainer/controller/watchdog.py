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
``first_timeout_s``. Calls that run in the controller's own process (the ``single`` strategy, an
in-process rank) are not watched: there, a debugger or ``py-spy dump`` on the controller shows them.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from rltrainer.controller.worker_group import WorkerError


class StageTimeout(WorkerError):
    """A stage ran past its timeout: ``stage``, ``ranks`` (those that had not answered),
    ``waited_s``, ``timeout_s`` and ``stacks`` (rank -> Python stack, or why there is none)."""

    def __init__(self, group: str, method: str, ranks: Sequence[int], waited_s: float, timeout_s: float,
                 stacks: Mapping[int, str], in_flight: Sequence[str] = ()) -> None:
        self.stage, self.ranks, self.waited_s, self.timeout_s = f"{group}.{method}", list(ranks), waited_s, timeout_s
        self.stacks = dict(stacks)
        lines = [f"Stage {self.stage!r} exceeded its timeout of {timeout_s:.0f} s (waited {waited_s:.0f} s): "
                 f"ranks {self.ranks} of {group!r} have not answered. Everything is shut down.",
                 "If the stage is only slow, raise its timeout: Trainer(stage_timeout_s={" + repr(method)
                 + ": seconds}) (or one number for every stage)."]
        if in_flight:
            lines.append("Other stages in flight: " + "; ".join(in_flight))
        for rank in self.ranks:
            lines.append(f"--- rank {rank}: Python stack ---\n{self.stacks.get(rank, '(not obtained)').rstrip()}")
        super().__init__(group, self.ranks[0] if self.ranks else -1, method, "\n".join(lines))


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
        timeouts = timeout_s.values() if isinstance(timeout_s, Mapping) else [timeout_s]
        if any(t is not None and (not isinstance(t, (int, float)) or t <= 0) for t in timeouts):
            raise ValueError(f"stage_timeout_s must be positive seconds, a dict of them by stage or method name "
                             f"(e.g. {{'train_step': 600}}), or None for the default; got {timeout_s!r}")
        if factor <= 0 or floor_s <= 0 or first_timeout_s <= 0:
            raise ValueError(f"factor, floor_s and first_timeout_s must be positive, got {factor}, {floor_s}, "
                             f"{first_timeout_s}")
        self.timeout_s, self.factor, self.floor_s, self.first_timeout_s = timeout_s, factor, floor_s, first_timeout_s
        self.window = window
        self._durations: dict[str, deque[float]] = {}
        self._in_flight: dict[int, tuple[str, float]] = {}  # call id -> (stage, start)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def timeout_for(self, stage: str) -> float:
        """Seconds ``stage`` (``group.method``) may take now."""
        method = stage.rsplit(".", 1)[-1]
        if isinstance(self.timeout_s, Mapping):
            fixed = self.timeout_s.get(stage, self.timeout_s.get(method))
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
        with self._lock:
            call = next(self._ids)
            self._in_flight[call] = (stage, time.monotonic())
        return call

    def end(self, call: int, completed: bool = True) -> None:
        """The call ended; a completed call's duration joins its stage's median."""
        with self._lock:
            stage, start = self._in_flight.pop(call, (None, 0.0))
            if stage is not None and completed:
                self._durations.setdefault(stage, deque(maxlen=self.window)).append(time.monotonic() - start)

    def in_flight(self, exclude: int | None = None) -> list[str]:
        """The stages in flight now, as ``"rollout.generate for 12 s"``."""
        now = time.monotonic()
        with self._lock:
            return [f"{stage} for {now - start:.0f} s" for call, (stage, start) in self._in_flight.items()
                    if call != exclude]


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
