"""Moving weights from a Strategy's training layout to a RolloutEngine: version counters (send
only what changed), buckets (bound the extra memory), and packed buckets (one flat buffer that
crosses a process boundary without per-tensor pickling).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")

DEFAULT_BUCKET_BYTES = 256 << 20
_ALIGN = 64


class ParamVersions:
    """One counter per parameter name, bumped when an optimizer step changes that parameter.

    ``synced`` remembers the version the engine last received, so a sync sends exactly the names
    whose counter moved since. Frozen parameters (no gradient, so never stepped) keep their
    version and are skipped after the first sync. No tensor is hashed or compared.
    """

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.synced: dict[str, int] = {}

    def bump(self, names: Iterable[str]) -> None:
        for name in names:
            self.current[name] = self.current.get(name, 0) + 1

    def changed(self, names: Iterable[str]) -> list[str]:
        """Names never synced, or changed since the last sync."""
        return [n for n in names if self.synced.get(n, -1) != self.current.get(n, 0)]

    def mark_synced(self, names: Iterable[str]) -> None:
        for name in names:
            self.synced[name] = self.current.get(name, 0)

    def forget_synced(self) -> None:
        """The engine lost its weights (new engine, restored checkpoint): send everything next time."""
        self.synced.clear()


def stepped_parameter_names(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Parameters an optimizer step may change: trainable and holding a gradient."""
    return [n for n, p in named_params if p.requires_grad and p.grad is not None]


def plan_buckets(named_nbytes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group names in order into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, nbytes in named_nbytes:
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def bucketed(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of ``(name, tensor)`` into lists of at most ``bucket_bytes``."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass
class PackedBucket:
    """Tensors of one bucket laid end to end in one byte buffer (a numpy array, so Ray moves it
    through its object store without pickling each tensor)."""

    buffer: np.ndarray  # [bytes] uint8
    entries: list[tuple[str, str, tuple[int, ...], int]] = field(default_factory=list)  # name, dtype, shape, offset


def pack_bucket(tensors: Sequence[tuple[str, torch.Tensor]]) -> PackedBucket:
    """Copy ``tensors`` (on any device) into one CPU byte buffer."""
    entries, offset = [], 0
    for name, t in tensors:
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for (name, _, _, start), (_, t) in zip(entries, tensors):
        nbytes = t.numel() * t.element_size()
        buffer[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return PackedBucket(buffer.numpy(), entries)


def unpack_bucket(packed: PackedBucket) -> list[tuple[str, torch.Tensor]]:
    """Views into the packed buffer (read-only when it came from Ray's object store: consumers copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the engine only reads
        buffer = torch.from_numpy(packed.buffer)
    out = []
    for name, dtype, shape, start in packed.entries:
        torch_dtype: Any = getattr(torch, dtype)
        numel = int(np.prod(shape)) if shape else 1
        nbytes = numel * torch.empty((), dtype=torch_dtype).element_size()
        out.append((name, buffer[start:start + nbytes].view(torch_dtype).view(shape)))
    return out


class SharedBuffers:
    """Two byte buffers in shared memory, mapped by every rank of one node (the CPU counterpart
    of CUDA IPC). A sync gathers a bucket by having each rank write its own rows of each tensor
    into one buffer, then every rank reads the full tensors from it: about two memory copies per
    byte instead of a trip through gloo's TCP transport. Buckets alternate between the two
    buffers, so one barrier per bucket keeps writers and readers apart.

    The files are unlinked as soon as every rank has mapped them, so nothing is left in
    ``directory`` even if a process dies later.
    """

    def __init__(self, directory: str, tag: str, rank: int) -> None:
        self.directory, self.tag, self.rank = directory, tag, rank
        self.buffers: list[torch.Tensor | None] = [None, None]
        self._generation = 0

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer ``index % 2`` with at least ``nbytes`` (a collective when it must grow)."""
        import os

        import torch.distributed as dist

        slot = index % 2
        current = self.buffers[slot]
        if current is not None and current.numel() >= nbytes:
            return current
        self._generation += 1
        path = os.path.join(self.directory, f"rltrainer-{self.tag}-{slot}-{self._generation}")
        if self.rank == 0:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        dist.barrier()
        self.buffers[slot] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier()
        if self.rank == 0:
            os.unlink(path)
        return self.buffers[slot]

    def close(self) -> None:
        self.buffers = [None, None]


def pipelined(count: int, start: Callable[[int], T], finish: Callable[[T], None], depth: int = 2) -> None:
    """``start(i)`` for each bucket ``i`` in order and ``finish`` each started item in order, with at
    most ``depth`` started and not yet finished: bucket ``i + 1`` is gathered while bucket ``i`` is
    still loading, and memory stays about ``depth`` buckets."""
    in_flight: list[T] = []
    for index in range(count):
        in_flight.append(start(index))
        if len(in_flight) == depth:
            finish(in_flight.pop(0))
    for item in in_flight:
        finish(item)
