"""Compiled CPU kernels of the delta codec (:mod:`rltrainer.weights.delta`), one pass each.

The reference codec is whole-array numpy/torch passes (a compare, a nonzero, gathers, steps,
offsets, a scatter: about 8 passes over the changed words, ~50 ns a changed word on a 2-core CPU).
These kernels do the same in one pass over the bucket, in `numba <https://numba.pydata.org>`_
(BSD-2-Clause; also a vLLM dependency), and write the same bytes: ``tests/weights/test_delta.py``
checks every payload and checksum against the reference. Without numba (:func:`kernels` returns
``None``) the reference runs; on a GPU the torch passes run at memory speed and are used instead.

The kernels work on flat numpy views of one word dtype (int16 for bf16, int32 for fp32, ...), so
one compiled kernel serves every tensor of that word size; they release the GIL.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

ENABLED = True  # False: the reference codec runs (the tests and the benchmark compare the two)
MAX_THREADS = 4
_compiled: SimpleNamespace | bool | None = None
_pool: ThreadPoolExecutor | None = None  # one per process, for the parts of a large bucket

BLOCK_SHIFT = 16  # a delta's places: a 16-bit offset in each 65,536-word block


def _encode(new, base, new64, base64, start, limit, k, e, steps, offsets, counts, esc_pos, esc_val, stop,
            small_steps):
    """Compare ``new`` with ``base`` (one tensor's words; ``start``: its first word in the bucket;
    ``new64``/``base64``: the same bytes as int64, up to a multiple of 32 bytes), record each changed
    word (int8 step, 16-bit offset, count per block, escapes) after the ``k`` and ``e`` already
    recorded, and move ``base`` to ``new``. Past ``limit`` changed words nothing more is recorded:
    with ``stop`` it returns at once (``base`` left partly moved), else it goes on counting and
    copying. Returns ``(k, e, done)``: changed words seen so far (more than ``limit``: too many),
    escapes, and how many of the tensor's words it got through.

    It compares 32 bytes at a time as four int64 (a clean group, most of them, costs four
    compares); only a group with a change, and the words past the last whole group, are visited
    word by word."""
    n = new.shape[0]
    per = 32 // new.itemsize
    groups = new64.shape[0] // 4
    g = 0
    while g <= groups:
        if g < groups:
            q = g * 4
            if ((new64[q] ^ base64[q]) | (new64[q + 1] ^ base64[q + 1]) | (new64[q + 2] ^ base64[q + 2])
                    | (new64[q + 3] ^ base64[q + 3])) == 0:
                g += 1
                continue
            first, last = g * per, g * per + per
        else:
            first, last = groups * per, n
        for j in range(first, last):
            value = new[j]
            if value != base[j]:
                if k < limit:
                    at = start + j
                    step = np.int64(value) - np.int64(base[j])
                    if small_steps and -128 <= step <= 127:
                        steps[k] = step
                    else:  # an escape (past the escapes' room: counted, the caller sends in full)
                        steps[k] = 0
                        if e < esc_pos.shape[0]:
                            esc_pos[e] = k
                            esc_val[e] = value
                        e += 1
                    offsets[k] = at & 0xFFFF
                    counts[at >> BLOCK_SHIFT] += 1
                k += 1
                base[j] = value
        if k > limit and stop:
            return k, e, last
        g += 1
    return k, e, n


def _apply(words, start, k, block, left, steps, offsets, counts, esc_pos, esc_val, e):
    """Apply a delta's entries that fall in ``words`` (one tensor; ``start``: its first word in the
    bucket) from entry ``k`` on (``block``: that entry's block, ``left``: entries left in it; ``e``:
    the next escape). Returns the state after the tensor: ``(k, block, left, e)``."""
    end = start + words.shape[0]
    total = steps.shape[0]
    while k < total:
        while left == 0:
            block += 1
            left = counts[block]
        at = (block << BLOCK_SHIFT) + (np.int64(offsets[k]) & 0xFFFF)
        if at >= end:
            break
        if e < esc_pos.shape[0] and esc_pos[e] == k:
            words[at - start] = esc_val[e]
            e += 1
        else:
            words[at - start] = np.int64(words[at - start]) + np.int64(steps[k])
        k += 1
        left -= 1
    return k, block, left, e


def kernels() -> SimpleNamespace | None:
    """The compiled kernels (``encode_words``, ``apply_words``), or ``None`` without numba (or with
    ``ENABLED`` off). numba is imported on first use, not with rltrainer: llvmlite in a process
    before vLLM 0.32 (CPU) builds its engine breaks vLLM's scan of ``sys.modules`` for Triton kernels
    (``vars(value).get`` on llvmlite's ``_lib_fn_wrapper``), and a rollout process builds its engine
    before its first delta."""
    global _compiled
    if not ENABLED:
        return None
    if _compiled is None:
        try:
            from numba import njit
        except ImportError:  # pragma: no cover - numba is a dependency; the reference codec runs without it
            _compiled = False
        else:
            _compiled = SimpleNamespace(encode_words=njit(nogil=True, cache=True)(_encode),
                                        apply_words=njit(nogil=True, cache=True)(_apply))
    return _compiled or None


# -- a bucket in parts, one thread each -------------------------------------------------------------

def threads(parts: int) -> int:
    """How many threads a bucket of ``parts`` parts uses: ``torch.get_num_threads()``, at most
    ``MAX_THREADS`` and ``parts``."""
    return min(max(torch.get_num_threads(), 1), MAX_THREADS, parts)


def run(fn: Callable[[tuple], Any], jobs: list[tuple]) -> list[Any]:
    """``fn`` over ``jobs``, on the process's thread pool when there are several (the kernels
    release the GIL)."""
    global _pool
    if len(jobs) <= 1:
        return [fn(job) for job in jobs]
    if _pool is None:
        _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="delta-codec")
    return list(_pool.map(fn, jobs))


def cut(spans: list[tuple[np.ndarray, np.ndarray | None, int]], lo: int,
        hi: int) -> list[tuple[np.ndarray, np.ndarray | None, int]]:
    """The pieces of ``spans`` (``(words, base words or None, first word in the bucket)``) in the
    bucket's words ``[lo, hi)``."""
    out = []
    for new, old, start in spans:
        first, last = max(lo - start, 0), min(hi - start, new.shape[0])
        if first < last:
            out.append((new[first:last], None if old is None else old[first:last], start + first))
    return out


def encode_part(job: tuple) -> tuple[int, int, int, bool]:
    """The encoder over one chunk's pieces (:func:`cut`), after the ``k`` changes and ``e`` escapes
    its thread's buffers hold; ``(changed, escapes, words scanned, stopped past the limit)``."""
    spans, limit, counts, (steps, offsets, positions, values), small_steps, k, e = job
    encode = kernels().encode_words
    scanned = 0
    for new, old, start in spans:
        whole = new.nbytes // 32 * 32 // new.itemsize
        k, e, done = encode(new, old, new[:whole].view(np.int64), old[:whole].view(np.int64), start, limit, k, e,
                            steps, offsets, counts, positions, values, True, small_steps)
        scanned += done
        if k > limit or e > positions.shape[0]:
            return k, e, scanned, True
    return k, e, scanned, False


def apply_part(job: tuple) -> None:
    """A delta's entries from ``k`` (the first of block ``block + 1``; ``e``: the next escape) into
    one part's pieces (:func:`cut`: its blocks' words)."""
    spans, k, block, e, (steps, offsets, counts, positions, values) = job
    apply = kernels().apply_words
    left = 0
    for words, _, start in spans:
        k, block, left, e = apply(words, start, k, block, left, steps, offsets, counts, positions, values, e)
        if k == steps.shape[0]:
            return
