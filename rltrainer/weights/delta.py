"""Delta weight sync: send only the words of a bucket that changed since the engines' last copy.

Between two RL steps at a realistic learning rate most engine-dtype weights do not change: the
fp32 master weights move by less than one bf16 ulp. With ``Rollout(delta=...)`` on (a
:class:`DeltaSync`), trainer rank 0 keeps a copy of what the engines hold, one tensor per weight
name in the engine's dtype (:class:`DeltaEncoder`, "the base"), and codes each bucket as:

- a **delta**: the words (2 bytes for bf16, 4 for fp32) of the bucket's bytes that differ from the
  base, each as its step from the base (an int8; its value if the step is larger) and its place (a
  16-bit offset in its 65,536-word block): 3 bytes a changed word (:func:`pack_delta`), when that
  is at most ``max_share`` of the bucket's bytes;
- else the **full** bucket (early steps, a high learning rate, fp32 engines), decided per bucket
  from the measured share of changed words.

The receiving side (:class:`DeltaDecoder`) applies a delta in place: to the engine's own tensors
when the engine holds the weights whole under their HF names (``RolloutEngine.weight_tensors``:
the ``hf`` engine), else to a copy of what it loaded (a mirror, one engine-dtype copy per rollout
process) whose touched tensors are then loaded through ``update_weights`` (vLLM's fused and
sharded layout). Every ``checksum_every``-th sync, each tensor's :func:`checksum` after the update
is compared with the sender's; a mismatch leaves the engine's version where it was and the
controller sends those buckets again in full from the base (counted as ``sync/checksum_mismatches``).

A name with no base (the first sync, a new engine, a woken engine that dropped its weights, a
restored run: ``ParamVersions.forget_synced``) goes in full first.

Memory: the base is one engine-dtype copy of the synced weights on trainer rank 0, a mirror one per
rollout process of an engine that lends no tensors (vLLM). ``DeltaSync.copies`` puts them in host
memory (the default: a GPU's gather is copied to a pinned host buffer a bucket at a time and
scanned there) or on the device. A scan on a device compares ``DEVICE_SCAN_WORDS`` words at a
time and stops once the changes pass the bucket's budget, so beside the base and the bucket it
holds at most one chunk's compare and indices and the indices it kept (within the budget).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rltrainer.values import check_float, check_int
from rltrainer.weights import _kernels
from rltrainer.weights.wire import (Encoding, Entry, bucket_nbytes, bucket_views, entry_offsets, flatten_bucket,
                                   flatten_into, itemsize)

WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_WORDS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_CHECK_COLUMNS = 1024
COPIES = ("host", "device")


@dataclass(frozen=True)
class DeltaSync:
    """``Rollout(delta=DeltaSync(...))`` (``True``: these defaults).

    Args:
        max_share: a bucket travels as a delta when its payload (steps and offsets) is at most this
            share of its full bytes (0 < max_share <= 1); else in full, and it backs off (see
            :meth:`DeltaEncoder.encode`). The default, 0.1 (up to 6.7% of a bf16 bucket's words
            changed), keeps deltas where they pay on a 2-core CPU, whose transports run near memory
            speed (``tests/benchmarks/bench_delta_sync.py``: with 2% changed a delta sync is 0.81x a
            full one over Ray's object store, 1.08x over shared memory); raise it where the link is
            slow.
        checksum_every: verify the engines' weights against the sender's every this many syncs
            (1: every sync; 0: never).
        copies: where delta sync keeps its copies of the weights (trainer rank 0's base; each
            rollout process's mirror, for an engine that lends no tensors, and its staged buckets).
            ``"host"`` (the default): host memory. vLLM sizes its weights and KV cache to
            ``gpu_memory_utilization`` when it starts, so a copy of the model beside it on its GPU
            runs the first sync out of memory at 0.9; in host memory it costs each sync a copy over
            PCIe per side (the sender copies each gathered bucket to the host and scans it there;
            vLLM loads a touched bucket from the host). Only the sender's one bucket-sized transfer
            buffer is pinned: torch's pinned allocator rounds a block up to a power of two and keeps
            freed ones. ``"device"``: beside the weights (the gathers' device, the receiver's): no
            PCIe copy, but one engine-dtype copy of the synced weights on each side's device, which
            the engine's memory share must leave room for (lower ``gpu_memory_utilization`` by it).
    """

    max_share: float = 0.1
    checksum_every: int = 1
    copies: str = "host"

    def __post_init__(self) -> None:
        check_float("max_share", self.max_share, above=0, at_most=1, owner="DeltaSync",
                    meaning="a share of the bucket's bytes")
        check_int("checksum_every", self.checksum_every, at_least=0, owner="DeltaSync", meaning="0: never verify")
        if self.copies not in COPIES:
            raise ValueError(f"DeltaSync(copies={self.copies!r}): one of {', '.join(map(repr, COPIES))} (where the "
                             "base and the mirrors live: host memory, or beside the weights on their device)")

    def home(self, device: torch.device) -> torch.device:
        """Where copies of weights on ``device`` are kept."""
        return torch.device("cpu") if self.copies == "host" else device

    @classmethod
    def resolve(cls, value: bool | DeltaSync | None) -> DeltaSync | None:
        """``Rollout(delta=...)`` as settings (``None``: off)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"delta={value!r}; pass True, False or DeltaSync(max_share=..., checksum_every=...)")


def checksum(tensor: torch.Tensor) -> int:
    """A 64-bit checksum of a tensor's bytes, the same on any device and thread count (integer sums,
    exact modulo 2**64) of its 8-byte words: their total (any one changed word changes it) and their
    sums weighted by row and by column of a ``[-1, 1024]`` view (two swapped words change those)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    head = data.numel() // 8 * 8
    words = data[:head]
    if words.data_ptr() % 8:
        words = words.clone()
    words = words.view(torch.int64)
    rows = words[:words.numel() // _CHECK_COLUMNS * _CHECK_COLUMNS].view(-1, _CHECK_COLUMNS)
    tail = words[rows.numel():]
    parts = [data.numel(), int(tail.sum()), int((tail * torch.arange(1, tail.numel() + 1, device=tail.device)).sum())]
    if rows.numel():  # two passes: row sums and column sums (numpy's column sums on CPU: 3x torch's)
        row_sums = rows.sum(1)
        col_sums = torch.from_numpy(rows.numpy().sum(0)) if rows.device.type == "cpu" else rows.sum(0)
        parts += [int(row_sums.sum()), int((row_sums * torch.arange(1, row_sums.numel() + 1, device=rows.device)).sum()),
                  int((col_sums * torch.arange(1, _CHECK_COLUMNS + 1, device=rows.device)).sum())]
    parts.extend(int(b) for b in data[head:].cpu().tolist())
    out = 0
    for part in parts:
        out = (out * 1_000_003 + part) % (1 << 64)
    return out


def word_bytes(entries: Sequence[Entry]) -> int:
    """The word a bucket's delta is counted in: its smallest element size (every entry starts at a
    multiple of it)."""
    return min((itemsize(getattr(torch, dtype)) for _, dtype, _ in entries), default=1)


def as_words(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """A tensor's bytes as a flat view of ``word``-byte integers (a view where it can be)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).view(WORD_DTYPES[word])


def _take(words: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``words[indices]`` (numpy's on CPU: several times faster than torch's indexing there)."""
    if words.device.type == "cpu":
        return torch.from_numpy(words.numpy()[indices.numpy()])
    return words[indices]


def _put(words: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``words[indices] = values``, in place."""
    if words.device.type == "cpu":
        words.numpy()[indices.numpy()] = values.numpy()
    else:
        words[indices] = values


_SCAN_WORDS = 1 << 21  # a CPU scan compares this many words at a time (cache-sized)
DEVICE_SCAN_WORDS = 1 << 22  # a device scan's chunk: its compare and indices take at most 9 bytes a word of it


def changed_words(new: torch.Tensor, old: torch.Tensor, limit: float = math.inf,
                  chunk: int | None = None) -> tuple[torch.Tensor | None, int]:
    """The indices (int64, ascending) of the words where ``new`` differs from ``old`` (flat word views
    of one tensor), or ``None`` as soon as more than ``limit`` differ (the caller sends in full); and
    how many words it compared. It compares ``chunk`` words at a time and stops after the chunk
    that passes ``limit``: besides the indices it keeps (at most ``limit``), it holds one chunk's
    compare and indices. On CPU it compares cache-sized chunks with numpy (torch's ``ne`` and
    ``nonzero`` cost several times more there); the compiled codec (:mod:`._kernels`) replaces it."""
    if new.device.type != "cpu":
        return _changed_chunks(new, old, limit, chunk or DEVICE_SCAN_WORDS)
    a, b = new.numpy(), old.numpy()
    parts, count = [], 0
    for start in range(0, a.size, _SCAN_WORDS):
        part = np.flatnonzero(np.not_equal(a[start:start + _SCAN_WORDS], b[start:start + _SCAN_WORDS]))
        if part.size:
            count += part.size
            if count > limit:
                return None, min(start + _SCAN_WORDS, a.size)
            parts.append(part + start)
    return (torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.int64)), a.size


def _changed_chunks(new: torch.Tensor, old: torch.Tensor, limit: float, chunk: int) -> tuple[torch.Tensor | None, int]:
    """:func:`changed_words` by torch passes over ``chunk`` words at a time (a GPU's; each chunk's
    count is read back, as ``nonzero`` does anyway)."""
    parts, count = [], 0
    for start in range(0, new.numel(), chunk):
        part = torch.ne(new[start:start + chunk], old[start:start + chunk]).nonzero().view(-1)
        if part.numel():
            count += part.numel()
            if count > limit:
                return None, min(start + chunk, new.numel())
            parts.append(part.add_(start))
    if not parts:
        return new.new_empty(0, dtype=torch.int64), new.numel()
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), new.numel()


def _word_offsets(entries: Sequence[Entry], word: int) -> list[int]:
    return [offset // word for offset in entry_offsets(entries)]


class DeltaEncoder:
    """Trainer rank 0's side: the base (what the engines hold) and each bucket's coding."""

    def __init__(self, settings: DeltaSync) -> None:
        self.settings = settings
        self.base: dict[str, torch.Tensor] = {}  # name -> flat words, in the engine's dtype
        self.syncs = 0
        self._counted = (0, 0, False)  # the last bucket's changed and scanned words, and whether it had too many
        self._backoff: dict[tuple[str, ...], tuple[int, int]] = {}  # bucket -> (scan again at sync, interval)
        self._spare: dict[str, torch.Tensor] = {}  # dropped bases' memory, reused by the next base
        self._buffers: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        self._host: torch.Tensor | None = None  # a device's bucket, copied where the base is (copies="host")

    @property
    def nbytes(self) -> int:
        """The base's memory (a bucket backing off keeps its base's memory for the next base)."""
        return sum(t.numel() * t.element_size() for t in [*self.base.values(), *self._spare.values()])

    def begin_sync(self, fresh: Iterable[str]) -> None:
        """A sync starts; ``fresh``: names the engines may not hold (never synced, or forgotten) go in full."""
        self._drop(fresh)
        self.syncs += 1

    def forget(self) -> None:
        self.base.clear()
        self._spare.clear()
        self._backoff.clear()

    def _drop(self, names: Iterable[str]) -> None:
        """These names' bases no longer say what the engines hold (their memory is kept for the next)."""
        for name in names:
            old = self.base.pop(name, None)
            if old is not None:
                self._spare[name] = old

    def _rebase(self, name: str, new: torch.Tensor) -> None:
        """A new base for ``name``: a copy of ``new`` (into its old memory where it has some: no page faults)."""
        spare = self._spare.pop(name, None)
        if spare is not None and spare.dtype == new.dtype and spare.shape == new.shape and spare.device == new.device:
            self.base[name] = spare.copy_(new)
        else:
            self.base[name] = new.clone()

    @property
    def verifies(self) -> bool:
        """Whether this sync's buckets carry checksums."""
        every = self.settings.checksum_every
        return every > 0 and (self.syncs - 1) % every == 0

    def encode(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry],
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, Encoding]:
        """Code one bucket (``tensors`` by name, in the engine's dtype) and move the base to it;
        returns the payload (uint8, on the tensors' device; a full bucket is written into ``out``
        where given, a shared-memory slot, and the payload is that view) and its :class:`Encoding`.

        A bucket whose scan finds more than ``max_share`` changed stops scanning there, goes in
        full and drops its base; it then goes in full for 2 syncs (4, 8, up to 16 while it keeps
        failing), unscanned, takes a new base on the last of them and is scanned again on the next.
        So a high learning rate costs a full sync plus, now and then, part of a scan and a copy (the
        "never slower than full" fallback)."""
        start = time.perf_counter()
        word = word_bytes(entries)
        full_nbytes = sum(math.prod(shape) * itemsize(getattr(torch, dtype)) for _, dtype, shape in entries)
        words = full_nbytes // word
        blocks = -(-words // BLOCK_WORDS)
        budget = (self.settings.max_share * full_nbytes - 16 - 4 * blocks) / 3  # words a delta may carry (3 bytes each)
        device = next(iter(tensors.values())).device
        key = tuple(name for name, _, _ in entries)
        backoff = self._backoff.get(key)
        if backoff is not None and self.syncs < backoff[0] - 1:  # full without a scan (nor a base)
            self._drop(key)
            payload = _flatten(tensors, entries, device, out)
            return payload, Encoding("full", int(payload.numel()), full_nbytes, word, words, 0, scanned=0,
                                     encode_s=time.perf_counter() - start)
        home = self.settings.home(device)
        if home != device:  # the base is in host memory: the bucket is scanned there
            tensors, device = self._to_home(tensors, entries, device), home
        compiled = device.type == "cpu" and _kernels.kernels() is not None
        escape_room = int(self.settings.max_share * full_nbytes / (7 + word)) + 1  # each costs 7 + word bytes
        coded = (self._encode_compiled if compiled else self._encode_reference)(tensors, entries, word, blocks, budget,
                                                                               escape_room, device)
        changed, scanned, overflow = self._counted
        if coded is not None and coded[0].numel() > self.settings.max_share * full_nbytes:  # many escapes (rare)
            coded, overflow = None, True
            self._drop(key)
        if coded is None:
            payload, kind, escapes = _flatten(tensors, entries, device, out), "full", 0
            if overflow:  # too many changed: back off (a bucket with no base is not a failure)
                interval = min(2 * backoff[1], 16) if backoff is not None else 2
                self._backoff[key] = (self.syncs + interval + 1, interval)
        else:
            (payload, escapes), kind = coded, "delta"
            self._backoff.pop(key, None)
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        sums = tuple(checksum(self.base[name]) for name in key) if self.verifies and kind == "delta" else ()
        return payload, Encoding(kind, int(payload.numel()), full_nbytes, word, words, changed, escapes, sums,
                                 encode_s, time.perf_counter() - start, scanned=scanned)

    def _to_home(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry],
                 source: torch.device) -> dict[str, torch.Tensor]:
        """The bucket's tensors copied into one host buffer (kept for the next bucket; pinned from a
        GPU, so the copy runs at the link's speed)."""
        nbytes = bucket_nbytes(entries)
        if self._host is None or self._host.numel() < nbytes:
            self._host = None  # freed before the larger one is taken
            self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=source.type == "cuda")
        return dict(bucket_views(self._host[:flatten_into(self._host, tensors, entries)], entries))

    def _encode_compiled(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry], word: int, blocks: int,
                         budget: float, escape_room: int, device: torch.device) -> tuple[torch.Tensor, int] | None:
        """:meth:`_encode_reference` in one compiled pass (:mod:`._kernels`), the same bytes
        (``escape_room``: more escapes than this and the payload exceeds ``max_share``). The bucket
        is scanned in chunks of ``PARALLEL_WORDS`` words (whole blocks), a round of chunks at a time,
        one per thread (``torch.get_num_threads()``, at most 4: the kernels release the GIL); the
        scan stops after the round in which the changes passed the budget, or after the first round
        (chunks spread over the bucket: a sample) if that projects ``EARLY_STOP`` times the budget."""
        limit = max(int(budget), 0)
        pairs = [(as_words(tensors[name], word), self.base.get(name)) for name, _, _ in entries]
        if any(_no_base(old, new) for new, old in pairs):
            changed = 0  # a name with no base: the bucket goes in full; every base is made current
            for (name, _, _), (new, old) in zip(entries, pairs):
                if _no_base(old, new):
                    self._rebase(name, new)
                    changed += new.numel()
                else:
                    old.copy_(new)
            self._counted = (changed, changed, False)
            return None
        spans = [(new.numpy(), old.numpy(), start) for (new, old), start in zip(pairs, _word_offsets(entries, word))]
        step = max(PARALLEL_WORDS // BLOCK_WORDS, 1) * BLOCK_WORDS
        chunks = [(lo, min(lo + step, blocks * BLOCK_WORDS)) for lo in range(0, blocks * BLOCK_WORDS, step)]
        threads = _kernels.threads(len(chunks))
        order = list(range(len(chunks)))
        if len(chunks) > threads:  # the first round samples the bucket: chunks spread over it
            sample = sorted({len(chunks) * t // threads for t in range(threads)})
            order = sample + [c for c in order if c not in sample]
        scratch = [self._scratch(word, t, limit, escape_room) for t in range(threads)]
        counts = np.zeros(blocks, dtype=np.int32)  # chunks write disjoint blocks
        found = [(0, 0)] * threads  # per thread: changed words and escapes it recorded
        records = []  # per chunk: (chunk, thread, its first and last change, its first and last escape)
        scanned, overflow = 0, False
        for first in range(0, len(order), threads):
            batch = order[first:first + threads]
            done = _kernels.run(_kernels.encode_part, [(_kernels.cut(spans, *chunks[c]), limit, counts, scratch[t],
                                                        word < 8, *found[t]) for t, c in enumerate(batch)])
            for t, (c, (k, e, words, stopped)) in enumerate(zip(batch, done)):
                records.append((c, t, found[t][0], k, found[t][1], e))
                found[t] = (k, e)
                scanned += words
                overflow = overflow or stopped
            changes = sum(k for k, _ in found)
            if first == 0 and len(order) > threads and changes * blocks * BLOCK_WORDS > EARLY_STOP * limit * scanned:
                overflow = True  # the sample says the bucket has too many: not worth scanning the rest
            if overflow or changes > limit or sum(e for _, e in found) > escape_room:
                overflow = True
                break
        k, e = sum(k for k, _ in found), sum(e for _, e in found)
        self._counted = (k, scanned, overflow)
        if overflow:
            self._drop(name for name, _, _ in entries)  # they no longer say what the engines hold
            return None
        counts_at, offsets_at, positions_at, values_at, total = delta_layout(k, word, blocks * BLOCK_WORDS, e)
        payload = torch.zeros(total, dtype=torch.uint8)
        out = payload.numpy()
        out[counts_at:offsets_at] = counts.view(np.uint8)
        at = escaped = 0
        for _, t, k0, k1, e0, e1 in sorted(records):  # in the bucket's order
            steps, offsets, positions, values = scratch[t]
            n, m = k1 - k0, e1 - e0
            out[at:at + n] = steps[k0:k1].view(np.uint8)
            out[offsets_at + 2 * at:offsets_at + 2 * (at + n)] = offsets[k0:k1].view(np.uint8)
            out[positions_at + 4 * escaped:positions_at + 4 * (escaped + m)] = (positions[e0:e1] + (at - k0)).view(
                np.uint8)
            out[values_at + word * escaped:values_at + word * (escaped + m)] = values[e0:e1].view(np.uint8)
            at, escaped = at + n, escaped + m
        return payload, e

    def _scratch(self, word: int, part: int, limit: int, escape_room: int) -> tuple[np.ndarray, ...]:
        """A part's buffers for the compiled encoder (kept: allocating them each sync costs page faults)."""
        have = self._buffers.get((word, part))
        if have is None or have[0].size < limit or have[2].size < escape_room:
            have = (np.empty(limit, np.int8), np.empty(limit, np.int16), np.empty(escape_room, np.int32),
                    np.empty(escape_room, _NUMPY_WORDS[word]))
            self._buffers[(word, part)] = have
        return have[0], have[1], have[2][:escape_room], have[3][:escape_room]

    def _encode_reference(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry], word: int, blocks: int,
                          budget: float, escape_room: int, device: torch.device) -> tuple[torch.Tensor, int] | None:
        """Move the base to ``tensors`` and pack the bucket's changed words (:func:`pack_delta`), or
        ``None`` if it goes in full (a name with no base, or more than ``budget`` changed: the base
        of its names is then dropped). ``self._counted``: ``(changed, scanned, too many)``."""
        indices, values, steps, changed, scanned, full, overflow = [], [], [], 0, 0, False, False
        for (name, _, _), offset in zip(entries, _word_offsets(entries, word)):
            new = as_words(tensors[name], word)
            old = self.base.get(name)
            if _no_base(old, new):
                self._rebase(name, new)
                changed, scanned, full = changed + new.numel(), scanned + new.numel(), True
                continue
            if full:
                old.copy_(new)
                continue
            found, compared = changed_words(new, old, limit=budget - changed)
            scanned += compared
            if found is None:  # too many for a delta
                changed, full, overflow = int(budget) + 1, True, True
                self._drop(other for other, _, _ in entries)
                break
            if found.numel():
                moved = _take(new, found)
                steps.append(_steps(moved, _take(old, found)))
                _put(old, found, moved)
                changed += found.numel()
                indices.append(found.add_(offset))
                values.append(moved)
        self._counted = (int(changed), scanned, overflow)
        if full:
            return None
        if not indices:
            none = torch.empty(0, dtype=torch.int64, device=device)
            return pack_delta(none, torch.empty(0, dtype=WORD_DTYPES[word], device=device), none, word, blocks, device)
        return pack_delta(torch.cat(indices), torch.cat(values), torch.cat(steps), word, blocks, device)

    def full(self, entries: Sequence[Entry]) -> tuple[torch.Tensor, Encoding]:
        """A bucket in full from the base (to repair an engine whose checksum did not match)."""
        tensors = {name: self.base[name].view(torch.uint8).view(getattr(torch, dtype)).view(shape)
                   for name, dtype, shape in entries}
        payload = flatten_bucket(tensors, entries, "cpu")
        word = word_bytes(entries)
        sums = tuple(checksum(self.base[name]) for name, _, _ in entries)
        return payload, Encoding("full", int(payload.numel()), int(payload.numel()), word,
                                 int(payload.numel()) // word, 0, checksums=sums)


PARALLEL_WORDS = 1 << 22  # a bucket is cut into parts (one per thread) of at least this many words
EARLY_STOP = 1.5  # a first round of chunks whose share of changes projects this many budgets: the bucket goes full


def _no_base(old: torch.Tensor | None, new: torch.Tensor) -> bool:
    """Whether ``old`` (a base, or ``None``) cannot serve as ``new``'s base (missing, or another layout)."""
    return old is None or old.dtype != new.dtype or old.numel() != new.numel()


def _flatten(tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry], device: torch.device,
             out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return flatten_bucket(tensors, entries, device)
    return out[:flatten_into(out, tensors, entries)]


BLOCK_WORDS = 1 << 16  # a delta's indices: a 16-bit offset in each 65,536-word block, and a count per block


def _align(offset: int) -> int:
    return -(-offset // 8) * 8


def delta_layout(changed: int, word: int, words: int, escapes: int) -> tuple[int, int, int, int, int]:
    """Where a delta payload's parts start (bytes): its int32 count of changed words per block, their
    16-bit offsets, the escapes' int32 positions and their values; and its total size. The int8 steps
    come first, at 0."""
    counts = _align(changed)
    offsets = counts + 4 * -(-words // BLOCK_WORDS)
    positions = _align(offsets + 2 * changed)
    values = _align(positions + 4 * escapes)
    return counts, offsets, positions, values, values + word * escapes


def _steps(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new - old`` of changed words as integers (int64), where a small step is exact: a bf16 value
    that moved by a few ulps moves by as much in its bit pattern."""
    if new.element_size() == 8:
        return torch.full_like(new, 1 << 8, dtype=torch.int64)  # no int8 steps for 8-byte words
    return new.to(torch.int64) - old.to(torch.int64)


def pack_delta(indices: torch.Tensor, values: torch.Tensor, steps: torch.Tensor, word: int, blocks: int,
               device: torch.device) -> tuple[torch.Tensor, int]:
    """A delta's payload (:func:`delta_layout`): each changed word's step from the engines' copy as
    an int8 (bf16 weights move by an ulp or two: 1 byte instead of 2), its place (an int32 count per
    ``BLOCK_WORDS``-word block and a 16-bit offset in its block: 2 bytes instead of 4 or 8), and the
    values of the few whose step does not fit an int8 ("escapes", by position). 3 bytes a changed
    weight; returns the payload and its number of escapes."""
    small = (steps >= -128) & (steps <= 127)
    escaped = (~small).nonzero().view(-1)
    changed, escapes = indices.numel(), escaped.numel()
    counts_at, offsets_at, positions_at, values_at, total = delta_layout(changed, word, blocks * BLOCK_WORDS, escapes)
    payload = torch.zeros(total, dtype=torch.uint8, device=device)
    payload[:changed].view(torch.int8).copy_(torch.where(small, steps, 0).to(torch.int8))
    counts = torch.bincount(indices // BLOCK_WORDS, minlength=blocks).to(torch.int32)
    payload[counts_at:offsets_at].view(torch.int32).copy_(counts)
    local = indices % BLOCK_WORDS
    local = torch.where(local >= 1 << 15, local - BLOCK_WORDS, local).to(torch.int16)  # as uint16 bits
    payload[offsets_at:offsets_at + 2 * changed].view(torch.int16).copy_(local)
    payload[positions_at:positions_at + 4 * escapes].view(torch.int32).copy_(escaped.to(torch.int32))
    payload[values_at:].view(WORD_DTYPES[word]).copy_(values[escaped])
    return payload, escapes


def delta_parts(payload: torch.Tensor, encoding: Encoding) -> tuple[torch.Tensor, ...]:
    """A delta payload's parts as views: ``(steps [int8], counts per block [int32], offsets [int16,
    as uint16 bits], escape positions [int32], escape values [word])`` (see :func:`pack_delta`)."""
    count, word, escapes = encoding.changed, encoding.word, encoding.escapes
    counts_at, offsets_at, positions_at, values_at, _ = delta_layout(count, word, encoding.words, escapes)
    return (payload[:count].view(torch.int8), payload[counts_at:offsets_at].view(torch.int32),
            payload[offsets_at:offsets_at + 2 * count].view(torch.int16),
            payload[positions_at:positions_at + 4 * escapes].view(torch.int32),
            payload[values_at:].view(WORD_DTYPES[word]))


def split_delta(payload: torch.Tensor, encoding: Encoding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """A delta payload's ``(indices [int64, ascending], steps [int8], escape positions [int64],
    escape values)`` (see :func:`pack_delta`)."""
    steps, counts, offsets, positions, values = delta_parts(payload, encoding)
    blocks = -(-encoding.words // BLOCK_WORDS)
    local = offsets.to(torch.int64) % BLOCK_WORDS
    bases = torch.repeat_interleave(torch.arange(blocks, device=payload.device) * BLOCK_WORDS, counts.to(torch.int64))
    return bases + local, steps, positions.to(torch.int64), values


def _stepped(old: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``old + steps`` in ``old``'s integer dtype (the steps were taken exactly, so nothing wraps)."""
    return (old.to(torch.int64) + steps.to(torch.int64)).to(old.dtype)


class DeltaDecoder:
    """A rollout process's side: apply a bucket (full or delta) to its engine and verify it.

    Where the engine lends its own tensor of a name (``engine.weight_tensors(names)``, in the wire
    dtype and shape), a delta is scattered into it; else the decoder keeps a mirror of what the
    engine loaded under that name (an engine-dtype copy, built from full buckets, where
    ``settings.copies`` says) and loads the names a delta touched from it. vLLM lends none (its
    layers are fused and sharded); the ``hf`` engine lends each tensor it holds in the wire dtype,
    not one it keeps wider (a router kept in fp32 in a bf16 model)."""

    def __init__(self, settings: DeltaSync | None = None) -> None:
        self.settings = settings or DeltaSync()
        self.mirror: dict[str, torch.Tensor] = {}
        self.verify_s = 0.0  # seconds spent on checksums (summed; the gate reads it per sync)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.mirror.values())

    def apply(self, engine: Any, payload: torch.Tensor, entries: Sequence[Entry], encoding: Encoding) -> bool:
        """Load one bucket into ``engine`` (inside its update session); whether its checksums match
        (True when it carries none)."""
        word = encoding.word
        if encoding.kind == "full":
            views = bucket_views(payload, entries)
            engine.update_weights(views)
            own = _lent(engine, entries)  # after the load: an engine may hold a name only once loaded
            for name, tensor in views:
                if name not in own:
                    self._keep(name, as_words(tensor, word))
        else:
            own = _lent(engine, entries)
            targets = {n: own[n] if n in own else self.mirror.get(n) for n, _, _ in entries}
            if any(t is None for t in targets.values()):
                return False  # nothing to apply the delta to (a new replica): repaired in full
            devices = {t.device for t in targets.values()}
            if devices == {torch.device("cpu")} and encoding.changed and _kernels.kernels() is not None:
                self._apply_compiled(payload, entries, encoding, targets)
            elif encoding.changed:
                for device in devices:
                    self._apply_reference(payload, entries, encoding,
                                          {n: t for n, t in targets.items() if t.device == device}, device)
            mirrored = [entry for entry in entries if entry[0] not in own]
            if mirrored and encoding.changed:  # all of them: an engine may rebuild a fused layer from all of it
                engine.update_weights([(name, self.mirror[name].view(torch.uint8).view(getattr(torch, dtype)).view(shape))
                                       for name, dtype, shape in mirrored])
        for name in own:  # the engine's own tensor says what it holds; a mirror of it would go stale
            self.mirror.pop(name, None)
        if not encoding.checksums:
            return True
        start = time.perf_counter()
        held = {**self.mirror, **own}
        matched = all(name in held and checksum(held[name]) == expected
                      for (name, _, _), expected in zip(entries, encoding.checksums))
        self.verify_s += time.perf_counter() - start
        return matched

    def _keep(self, name: str, words: torch.Tensor) -> None:
        """Mirror ``words`` (what the engine was given under ``name``), in its old memory where it fits."""
        kept = self.mirror.get(name)
        home = self.settings.home(words.device)
        if kept is None or kept.shape != words.shape or kept.dtype != words.dtype or kept.device != home:
            kept = self.mirror[name] = torch.empty_like(words, device=home)  # not pinned: see DeltaSync.copies
        kept.copy_(words)

    @staticmethod
    def _apply_compiled(payload: torch.Tensor, entries: Sequence[Entry], encoding: Encoding,
                        targets: Mapping[str, torch.Tensor]) -> None:
        """A delta into CPU tensors, one compiled pass (:func:`._kernels.apply_words`) per touched
        tensor; a bucket of more than ``PARALLEL_WORDS`` words in parts at block edges, one thread each."""
        steps, counts, offsets, positions, values = (t.cpu().numpy() for t in delta_parts(payload, encoding))
        word = encoding.word
        blocks = counts.shape[0]
        spans = [(as_words(targets[name], word).numpy(), None, start)
                 for (name, _, _), start in zip(entries, _word_offsets(entries, word))]
        parts = _kernels.threads(min(max(blocks * BLOCK_WORDS // PARALLEL_WORDS, 1), blocks))
        cuts = [round(blocks * i / parts) for i in range(parts + 1)]
        firsts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # each block's first entry
        jobs = []
        for lo, hi in zip(cuts, cuts[1:]):
            k = int(firsts[lo])
            if k < firsts[hi]:
                jobs.append((_kernels.cut(spans, lo * BLOCK_WORDS, hi * BLOCK_WORDS), k, lo - 1,
                             int(np.searchsorted(positions, k)), (steps, offsets, counts, positions, values)))
        _kernels.run(_kernels.apply_part, jobs)

    @staticmethod
    def _apply_reference(payload: torch.Tensor, entries: Sequence[Entry], encoding: Encoding,
                         targets: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """A delta by whole-array passes (a GPU's, or without numba), into the names of ``targets``
        (all on ``device``)."""
        word = encoding.word
        indices, steps, positions, escaped = (t.to(device) for t in split_delta(payload, encoding))
        starts = _word_offsets(entries, word)
        bounds = torch.searchsorted(indices, torch.tensor(starts + [encoding.words], device=device)).tolist()
        with torch.no_grad():
            for (name, _, _), start, lo, hi in zip(entries, starts, bounds, bounds[1:]):
                if hi > lo and name in targets:
                    words = as_words(targets[name], word)
                    places = indices[lo:hi] - start
                    values = _stepped(_take(words, places), steps[lo:hi])
                    first, last = torch.searchsorted(positions, torch.tensor([lo, hi], device=device)).tolist()
                    values[positions[first:last] - lo] = escaped[first:last]
                    _put(words, places, values)

    def forget(self) -> None:
        self.mirror.clear()


def _lent(engine: Any, entries: Sequence[Entry]) -> dict[str, torch.Tensor]:
    """The engine's own tensors of a bucket's names that it lends whole in the wire dtype and shape
    (contiguous); the decoder mirrors the others."""
    lend = getattr(engine, "weight_tensors", None)
    own = (lend([name for name, _, _ in entries]) if lend is not None else None) or {}
    out = {}
    for name, dtype, shape in entries:
        tensor = own.get(name)
        if (tensor is not None and tensor.dtype == getattr(torch, dtype) and tuple(tensor.shape) == tuple(shape)
                and tensor.is_contiguous()):
            out[name] = tensor
    return out
