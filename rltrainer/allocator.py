"""Give glibc's freed heap back to the kernel between micro-batches (issue 16).

A training micro-batch allocates and frees hundreds of MB of buffers below glibc's mmap threshold
(activations, the LM head's chunks), so they come from the heap. Small long-lived allocations land
between them, the freed space cannot coalesce into the top of the heap (the only part glibc returns
by itself), and the next micro-batch, with the same shapes, grows the heap again: on the 4k GRPO
benchmark the process held 2.05 GB at its peak where 0.26 GB were in use (README of
``tests/benchmarks``, "Peak RSS on the 4k workload"). ``malloc_trim(0)`` hands every free page of
every arena back (``MADV_DONTNEED``), so the next micro-batch starts from the memory it needs.

The strategies' shared rank-side code (:func:`~rltrainer.strategies.strategy.run_compute`,
:func:`~rltrainer.strategies.strategy.run_train_step`) calls :func:`release_free_heap` before each
micro-batch and at the end of each stage, in whichever process trains: the controller's for the
``single`` strategy, each rank worker's for ``fsdp2`` and ``megatron``. Trimming costs page faults
(the next micro-batch touches the returned pages again: on the 4k benchmark, trimming at every
boundary cut the peak from 1.79 to 1.02 GB but raised system time 3.9x), so it trims only once the
process has grown by more than ``RLTRAINER_MALLOC_SLACK_MB`` (default 256) since the first boundary
after the last trim: a heap that stops growing is never trimmed.

It does nothing where the C library is not glibc (macOS, musl), when ``RLTRAINER_MALLOC=off``, or
when the user tunes glibc's allocator themselves (any ``MALLOC_*`` variable, or ``glibc.malloc``
in ``GLIBC_TUNABLES``): their settings are left to act alone. The choice is made once per process,
at the first call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: The opt-out: ``RLTRAINER_MALLOC=off`` leaves glibc's heap alone; ``trim`` (the default) trims it.
ENV_VAR = "RLTRAINER_MALLOC"
MODES = ("trim", "off")
#: How much the process may grow between trims, in MB.
SLACK_VAR = "RLTRAINER_MALLOC_SLACK_MB"
DEFAULT_SLACK_MB = 256


def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc with ``malloc_trim``, else ``None``."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "malloc_trim"):
        return None  # musl, macOS' libSystem, ...
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def user_malloc_settings(environ: Mapping[str, str]) -> list[str]:
    """The environment variables through which the user tunes glibc's allocator themselves."""
    names = [name for name in environ if name.startswith("MALLOC_")]
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return sorted(names)


def trim_mode(environ: Mapping[str, str]) -> str:
    """``"trim"`` or ``"off"``, from ``RLTRAINER_MALLOC`` (default ``trim``); raises on another value."""
    mode = environ.get(ENV_VAR, "trim").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={environ[ENV_VAR]!r} is not one of {', '.join(MODES)}. Unset it (or set "
                         f"{ENV_VAR}=trim) to give freed heap back between micro-batches, or set {ENV_VAR}=off.")
    return mode


def slack_bytes(environ: Mapping[str, str]) -> int:
    """The growth, in bytes, past which a boundary trims: ``RLTRAINER_MALLOC_SLACK_MB`` (default
    ``DEFAULT_SLACK_MB``); raises on a value that is not a finite number of MB >= 0."""
    text = environ.get(SLACK_VAR, str(DEFAULT_SLACK_MB))
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 <= mb < float("inf"):
        raise ValueError(f"{SLACK_VAR}={text!r} is not a finite number of MB >= 0. Unset it (default "
                         f"{DEFAULT_SLACK_MB}) or give one, e.g. {SLACK_VAR}=128 (lower: a lower peak, "
                         f"more page faults).")
    return int(mb * 2 ** 20)


@functools.cache
def _trimmer() -> _Trimmer | None:
    """What trims, or ``None``: decided once per process, at the first call."""
    mode = trim_mode(os.environ)
    if mode == "off":
        log.info("%s=off: glibc's free heap is not trimmed between micro-batches", ENV_VAR)
        return None
    user = user_malloc_settings(os.environ)
    if user:
        log.info("%s set: glibc's heap is left to these settings (no malloc_trim between micro-batches)",
                 ", ".join(user))
        return None
    libc = _glibc()
    if libc is None:
        log.debug("The C library is not glibc: no malloc_trim between micro-batches")
        return None
    return _Trimmer(libc, slack_bytes(os.environ))


class _Trimmer:
    """Trims when the process has grown by more than ``slack`` bytes since the first boundary after
    the last trim: in a steady state (each micro-batch reusing what the previous one freed) it never
    trims, so it costs no page faults; while the heap fragments it bounds the growth."""

    def __init__(self, libc: ctypes.CDLL, slack: int) -> None:
        self.libc, self.slack = libc, slack
        self.reference: int | None = None  # RSS at the first boundary after the last trim
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __call__(self) -> None:
        rss = self.rss()
        if self.reference is None:
            self.reference = rss
        elif rss > self.reference + self.slack:
            self.libc.malloc_trim(0)
            self.reference = None


def release_free_heap() -> None:
    """Return glibc's free heap pages to the kernel (``malloc_trim(0)``) if the process grew by
    more than the slack since the last trim; a no-op where disabled (see the module docstring).
    Call it between micro-batches or stages, not inside one."""
    trimmer = _trimmer()
    if trimmer is not None:
        trimmer()
