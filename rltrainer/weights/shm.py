"""Byte buffers in shared memory (``/dev/shm``), mapped by several processes of one node: the
CPU counterpart of CUDA IPC. Files are unlinked as soon as every process has mapped them, so
nothing is left behind even if a process dies later.

- :class:`SharedSlots`: two fixed-size slots that trainer rank 0 creates and the rollout
  processes (and, on one node, the other training ranks) open: the shared-memory transport's
  buffers. Bucket ``i`` of a sync goes to slot ``i % 2``; the transport keeps at most two buckets
  in flight, so a slot is written again only after its previous bucket has loaded.
- :class:`SharedBuffers`: the training ranks' gather buffers (FSDP2 on one CPU node), grown by a
  collective when a bucket needs more room.
"""

from __future__ import annotations

import os
import shutil

import torch

from rltrainer.process_groups import host_group

SLOTS = 2


def create_file(path: str, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.truncate(nbytes)


def map_file(path: str, nbytes: int) -> torch.Tensor:
    """``[nbytes]`` uint8 mapped from ``path`` (``MAP_SHARED``: writes are seen by every mapper)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def prefault(buffer: torch.Tensor, write: bool) -> None:
    """Fault ``buffer``'s pages in now (``write``: allocate them; else map them into this process),
    so that the first sync runs at memory speed instead of about 1 GB/s of page faults."""
    if write:
        buffer.zero_()
    elif buffer.numel():
        buffer[::4096].sum()  # one read per page


def shared_memory_room(directory: str = "/dev/shm") -> int:
    """Free bytes in ``directory`` (0 if it does not exist)."""
    if not os.path.isdir(directory):
        return 0
    return shutil.disk_usage(directory).free


class SharedSlots:
    """Two ``nbytes`` byte slots in shared memory.

    The creator (:meth:`create`) makes the files and maps them; every other process opens them by
    path (:meth:`open`); then the creator unlinks them (:meth:`unlink`). The mappings stay valid
    until :meth:`close` in each process.
    """

    def __init__(self, paths: list[str], nbytes: int, slots: list[torch.Tensor]) -> None:
        self.paths, self.nbytes, self.slots = paths, nbytes, slots

    @classmethod
    def create(cls, directory: str, tag: str, nbytes: int) -> SharedSlots:
        room = shared_memory_room(directory)
        if room < SLOTS * nbytes:
            raise RuntimeError(f"Shared-memory weight transport needs {SLOTS} x {nbytes / 2**20:.0f} MiB in "
                               f"{directory}, which has {room / 2**20:.0f} MiB free. Lower bucket_bytes, grow "
                               f"{directory}, or use Rollout(transport='object_store').")
        paths = [os.path.join(directory, f"rltrainer-weights-{tag}-{slot}") for slot in range(SLOTS)]
        try:
            for path in paths:
                create_file(path, nbytes)
            slots = [map_file(path, nbytes) for path in paths]
            for slot in slots:
                prefault(slot, write=True)
            return cls(paths, nbytes, slots)
        except BaseException:
            cls.unlink_paths(paths)
            raise

    @classmethod
    def open(cls, paths: list[str], nbytes: int) -> SharedSlots:
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise RuntimeError(f"Shared-memory weight slots {missing} do not exist in this process's view: is it on "
                               "trainer rank 0's node? (Rollout(transport='shared_memory') needs one node)")
        slots = [map_file(path, nbytes) for path in paths]
        for slot in slots:
            prefault(slot, write=False)
        return cls(list(paths), nbytes, slots)

    @staticmethod
    def unlink_paths(paths: list[str]) -> None:
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def unlink(self) -> None:
        """Remove the files (the mappings stay): call once every process has opened them."""
        self.unlink_paths(self.paths)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the slot of bucket ``index``."""
        if nbytes > self.nbytes:
            raise RuntimeError(f"A {nbytes}-byte bucket does not fit the {self.nbytes}-byte shared-memory slots "
                               "(they are sized for bucket_bytes and the largest tensor at connect time)")
        return self.slots[index % SLOTS][:nbytes]

    def close(self) -> None:
        self.slots = []


class SharedBuffers:
    """Two byte buffers in shared memory, mapped by every rank of one node. A sync gathers a bucket
    by having each rank write its own rows of each tensor into one buffer, then every rank reads
    the full tensors from it: about two memory copies per byte instead of a trip through gloo's
    TCP transport. Buckets alternate between the two buffers, so one barrier per bucket keeps
    writers and readers apart.
    """

    def __init__(self, directory: str, tag: str, rank: int) -> None:
        self.directory, self.tag, self.rank = directory, tag, rank
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self._generation = 0

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer ``index % 2`` with at least ``nbytes`` (a collective when it must grow)."""
        import torch.distributed as dist

        slot = index % SLOTS
        current = self.buffers[slot]
        if current is not None and current.numel() >= nbytes:
            return current
        self._generation += 1
        path = os.path.join(self.directory, f"rltrainer-{self.tag}-{slot}-{self._generation}")
        if self.rank == 0:
            create_file(path, nbytes)
        dist.barrier(group=host_group())  # host memory: its writers and readers meet on the host
        self.buffers[slot] = map_file(path, nbytes)
        dist.barrier(group=host_group())
        if self.rank == 0:
            os.unlink(path)
        return self.buffers[slot]

    def close(self) -> None:
        self.buffers = [None] * SLOTS
