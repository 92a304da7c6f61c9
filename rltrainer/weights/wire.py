"""The one wire format and the one bucketer of weight sync.

A bucket on the wire is one byte buffer holding its tensors end to end, no padding, in the
order of its :data:`Entry` list, larger elements first so that every view is aligned. That is
SGLang's ``load_format="flattened_bucket"``, and every transport moves exactly these bytes
(a broadcast, a shared-memory slot, a numpy array in Ray's object store); only the entries
(names, dtypes, shapes: small) travel beside them as call arguments.

Buckets are formed by :func:`bucket_by_bytes`, in stream order, each at most ``bucket_bytes``
(a larger tensor travels alone), so a sync needs about one bucket of extra memory per buffer
in flight.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")

Entry = tuple[str, str, tuple[int, ...]]  # hf name, dtype name ("bfloat16"), full shape
DEFAULT_BUCKET_BYTES = 256 << 20


# -- the bucketer --------------------------------------------------------------------------------
def bucket_by_bytes(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int) -> Iterator[list[T]]:
    """Group ``items`` in order into lists whose ``nbytes`` add up to at most ``bucket_bytes``; an
    item larger than that gets a list of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


def plan_buckets(named_nbytes: Sequence[tuple[str, int]], bucket_bytes: int,
                 groups: Iterable[Iterable[str]] = ()) -> list[list[str]]:
    """The names of each bucket, for ``(name, nbytes)`` in export order. The names of one of
    ``groups`` share a bucket (placed where the group's first name comes; a group larger than
    ``bucket_bytes`` travels alone)."""
    group_of = {name: i for i, group in enumerate(groups) for name in group}
    units: dict[Any, list[tuple[str, int]]] = {}  # a group, or one name, in order of first appearance
    for name, nbytes in named_nbytes:
        units.setdefault(("group", group_of[name]) if name in group_of else name, []).append((name, nbytes))
    buckets = bucket_by_bytes(units.values(), lambda unit: sum(n for _, n in unit), bucket_bytes)
    return [[name for unit in bucket for name, _ in unit] for bucket in buckets]


def bucketed(weights: Iterable[tuple[str, torch.Tensor]],
             bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A stream of ``(name, tensor)`` in buckets of at most ``bucket_bytes``."""
    return bucket_by_bytes(weights, lambda item: tensor_nbytes(item[1]), bucket_bytes)


# -- the byte layout -----------------------------------------------------------------------------
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def entry_nbytes(entry: Entry) -> int:
    """Bytes one wire entry takes in a bucket."""
    return math.prod(entry[2]) * itemsize(getattr(torch, entry[1]))


def bucket_nbytes(entries: Sequence[Entry]) -> int:
    return sum(entry_nbytes(e) for e in entries)


def bucket_entries(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> list[Entry]:
    """The wire order of one bucket's ``(name, shape, dtype)``: larger elements first (a stable
    sort), so each tensor starts at a multiple of its element size in the byte buffer."""
    ordered = sorted(specs, key=lambda spec: -itemsize(spec[2]))
    return [(name, str(dtype).removeprefix("torch."), tuple(int(d) for d in shape)) for name, shape, dtype in ordered]


def entry_offsets(entries: Sequence[Entry]) -> list[int]:
    """Where each entry starts in the bucket's bytes."""
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += entry_nbytes(entry)
    return offsets


def flatten_into(out: torch.Tensor, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry]) -> int:
    """Write the bucket's bytes into ``out`` (uint8, at least :func:`bucket_nbytes` long), in the
    order of ``entries``; returns the bytes written. One copy per tensor, from any device."""
    offset = 0
    for name, dtype, shape in entries:
        tensor = tensors[name]
        if tensor.dtype != getattr(torch, dtype) or tuple(tensor.shape) != shape:
            raise ValueError(f"Weight sync: {name!r} is {tensor.dtype} {tuple(tensor.shape)}, but the receivers "
                             f"were told {dtype} {shape} (weight_specs and gather_weights disagree)")
        nbytes = tensor_nbytes(tensor)
        out[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        offset += nbytes
    return offset


def flatten_bucket(tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry],
                   device: torch.device | str) -> torch.Tensor:
    """The bucket's bytes, ``[bucket_nbytes]`` uint8 on ``device``, in the order of ``entries``."""
    out = empty_bucket(entries, device)
    flatten_into(out, tensors, entries)
    return out


def empty_bucket(entries: Sequence[Entry], device: torch.device | str) -> torch.Tensor:
    """A receive buffer for one bucket."""
    return torch.empty(bucket_nbytes(entries), dtype=torch.uint8, device=device)


def bucket_views(buffer: torch.Tensor, entries: Sequence[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into a bucket's bytes (valid while ``buffer`` is)."""
    out = []
    for (name, dtype, shape), offset in zip(entries, entry_offsets(entries)):
        nbytes = entry_nbytes((name, dtype, shape))
        out.append((name, buffer[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)))
    return out


@dataclass(frozen=True)
class Encoding:
    """How a bucket's payload is coded when delta sync is on (:mod:`rltrainer.weights.delta`); it
    travels beside the payload as a call argument or a result (small). Without delta sync a bucket
    has no encoding: its payload is its bytes.

    ``kind="full"``: the payload is the bucket's bytes (wire layout). ``kind="delta"``: the payload is
    the ``changed`` words (``word`` bytes each) of the bucket's bytes that differ from what the engines
    hold, as int8 steps from what the engines hold, where they are (a count per 65,536-word block
    and a 16-bit offset each) and the ``escapes`` whose step does not fit an int8, by value
    (:func:`rltrainer.weights.delta.pack_delta`). ``checksums``:
    one per entry, of the entry's bytes after the update (:func:`~rltrainer.weights.delta.checksum`;
    empty: not verified this sync)."""

    kind: str
    nbytes: int  # payload bytes (on the wire)
    full_nbytes: int  # the bucket's bytes
    word: int
    words: int  # the bucket's bytes in words
    changed: int  # words that differ from the engines' copy (all of them for a name with no copy yet)
    escapes: int = 0  # changed words sent by value (their step does not fit an int8)
    checksums: tuple[int, ...] = ()
    encode_s: float = 0.0  # the sender's diff scan and encoding
    checksum_s: float = 0.0  # the sender's checksums
    scanned: int | None = None  # words compared with the engines' copy (None: all of them); a scan that
    # found too many stops early, and a bucket backing off goes in full unscanned

    def stats(self) -> dict[str, float]:
        """The sender's side of a bucket's stats (summed over a sync by the transports)."""
        scanned = self.words if self.scanned is None else self.scanned
        return {"wire_bytes": self.nbytes, "changed_words": self.changed, "scanned_words": scanned,
                "words": self.words, "delta_buckets": int(self.kind == "delta"), "encode_s": self.encode_s, "checksum_s": self.checksum_s}


@dataclass
class Bucket:
    """One bucket as a value: its entries and its bytes as a numpy array, so Ray's object store
    carries it without pickling each tensor (and a reader on the same node maps it, zero-copy).
    With delta sync on, ``encoding`` says how ``data`` is coded (``None``: it is the bucket's bytes)."""

    entries: list[Entry]
    data: np.ndarray  # [payload bytes] uint8
    encoding: Encoding | None = None

    @classmethod
    def pack(cls, tensors: Sequence[tuple[str, torch.Tensor]]) -> Bucket:
        """Copy ``(name, tensor)`` pairs (on any device) into one CPU bucket, in wire order."""
        entries = bucket_entries((name, tuple(t.shape), t.dtype) for name, t in tensors)
        return cls(entries, flatten_bucket(dict(tensors), entries, "cpu").numpy())

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the bytes (read-only when they came from Ray's object store: loaders copy)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the engine only reads
            return bucket_views(torch.from_numpy(self.data), self.entries)
