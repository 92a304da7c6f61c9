"""Split placement's weight transport: trainer rank 0 broadcasts each bucket to the rollout
engines over a process group of their own (NCCL when every member is on a GPU, else gloo).

The group is not the training group. Trainer rank 0 hosts a ``TCPStore`` and every member builds
its ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` directly on it, touching no ``torch.distributed``
global state, so it lives beside the training group in a trainer and beside vLLM's group in a
rollout worker. Store keys are laid out as SGLang's ``init_custom_process_group`` lays them out
(``PrefixStore(name)``, then torch's ``"{name}/"`` and ``"{device}/"`` prefixes), so SGLang's
scheduler processes join the same group through ``Engine.init_weights_update_group``.

Wire format of one bucket: one byte buffer holding the bucket's tensors end to end, no padding,
in the order of its :data:`Entry` list, larger elements first so that every view is aligned.
That is SGLang's ``load_format="flattened_bucket"``. The entries (names, dtypes, shapes) travel
as call arguments through Ray; the bytes travel in one broadcast.

:class:`BroadcastTransport` is the controller's side: it forms the group (every member at once,
with a timeout) and runs a sync bucket by bucket, with at most two buckets in flight.
"""

from __future__ import annotations

import datetime
import logging
import math
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rltrainer.controller.worker_group import WorkerGroup, get_together
from rltrainer.strategies.weights import pipelined

log = logging.getLogger(__name__)

Entry = tuple[str, str, tuple[int, ...]]  # hf name, dtype name ("bfloat16"), full shape
DEFAULT_TIMEOUT_S = 600.0


# -- the wire format -----------------------------------------------------------------------------
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def entry_nbytes(entry: Entry) -> int:
    """Bytes one wire entry takes in a bucket."""
    return math.prod(entry[2]) * _itemsize(getattr(torch, entry[1]))


def bucket_entries(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> list[Entry]:
    """The wire order of one bucket's ``(name, shape, dtype)``: larger elements first (a stable
    sort), so each tensor starts at a multiple of its element size in the byte buffer."""
    ordered = sorted(specs, key=lambda spec: -_itemsize(spec[2]))
    return [(name, str(dtype).removeprefix("torch."), tuple(int(d) for d in shape)) for name, shape, dtype in ordered]


def flatten_bucket(tensors: dict[str, torch.Tensor], entries: Sequence[Entry], device: torch.device) -> torch.Tensor:
    """The bucket's bytes, ``[sum of nbytes]`` uint8 on ``device``, in the order of ``entries``."""
    parts = []
    for name, dtype, shape in entries:
        tensor = tensors[name]
        if tensor.dtype != getattr(torch, dtype) or tuple(tensor.shape) != shape:
            raise ValueError(f"Weight broadcast: {name!r} is {tensor.dtype} {tuple(tensor.shape)}, but the receivers "
                             f"were told {dtype} {shape} (weight_specs and gather_weights disagree)")
        parts.append(tensor.detach().reshape(-1).view(torch.uint8))
    return torch.cat(parts).to(device)


def empty_bucket(entries: Sequence[Entry], device: torch.device | str) -> torch.Tensor:
    """A receive buffer for one bucket."""
    return torch.empty(sum(entry_nbytes(e) for e in entries), dtype=torch.uint8, device=device)


def bucket_views(buffer: torch.Tensor, entries: Sequence[Entry]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into a received byte buffer."""
    out, offset = [], 0
    for entry in entries:
        name, dtype, shape = entry
        nbytes = entry_nbytes(entry)
        out.append((name, buffer[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)))
        offset += nbytes
    return out


# -- one member of the group ---------------------------------------------------------------------
class WeightGroup:
    """One member (rank ``rank`` of ``world_size``) of a weight-broadcast group; rank 0 sends.

    Args:
        address / port: where rank 0 hosts the group's ``TCPStore``.
        group_name: the group's name (the store prefix; SGLang addresses the group by it).
        backend: ``"nccl"`` (every member's buffers on CUDA) or ``"gloo"``.
        timeout_s: how long to wait for the other members to join, and for each broadcast.

    Construction returns once every member has joined (it blocks until then, or raises after
    ``timeout_s``), so all members must construct it concurrently.
    """

    def __init__(self, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import Backend, BackendConfig

        if backend not in ("nccl", "gloo"):
            raise ValueError(f"Weight broadcast backend {backend!r}; choose from nccl, gloo")
        self.rank, self.world_size, self.group_name, self.backend_name = rank, world_size, group_name, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self._store = TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
            device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
            store = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, self._store)))
            self._backend = self._make_backend(store, backend, timeout)
            self._backend._set_sequence_number_for_group()  # as torch's group helper does (SGLang's side runs it)
        except Exception as exc:
            raise RuntimeError(
                f"Weight broadcast group {group_name!r} ({backend}, store at {address}:{port}): rank {rank} of "
                f"{world_size} could not form the group within {timeout_s:.0f} s. A member did not join (it died, "
                f"or cannot reach the address), or members disagree on world size or backend. Cause: {exc}"
            ) from exc

    def _make_backend(self, store: Any, backend: str, timeout: datetime.timedelta) -> Any:
        if backend == "gloo":
            from torch.distributed.distributed_c10d import ProcessGroupGloo

            return ProcessGroupGloo(store, self.rank, self.world_size, timeout)
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.group_name = self.group_name
        return ProcessGroupNCCL(store, self.rank, self.world_size, options)

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0 sends ``buffer``; every other rank receives into its ``buffer`` (same size)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._backend.broadcast([buffer], options).wait()
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()  # the buffer may be freed right after

    def close(self) -> None:
        backend, self._backend = getattr(self, "_backend", None), None
        shutdown = getattr(backend, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # a member may be gone already
                pass
        self._store = None


# -- the controller's side ---------------------------------------------------------------------
class BroadcastTransport:
    """Weights from trainer rank 0 to every rollout engine, one broadcast per bucket.

    Args:
        trainer: the training ranks (:class:`~rltrainer.strategies.distributed.TrainingWorker`).
        rollout: the rollout workers (:class:`~rltrainer.controller.worker.Worker`, engines set up).
        timeout_s: how long members wait for each other (joining, and in each broadcast).
    """

    def __init__(self, trainer: WorkerGroup, rollout: WorkerGroup, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.trainer, self.rollout, self.timeout_s = trainer, rollout, timeout_s
        self.group_name = f"rltrainer-weights-{uuid.uuid4().hex[:12]}"
        self.backend = "gloo"
        self.world_size = 0

    def connect(self) -> None:
        """Form the group: trainer rank 0 is rank 0; replica ``r`` takes as many ranks as its engine
        has receiving processes (SGLang: ``tp_size``), after the replicas before it."""
        trainer, rollout = self.trainer, self.rollout
        ranks = rollout.execute_all("engine_weight_group_ranks")
        offsets = [1 + sum(ranks[:r]) for r in range(len(ranks))]
        self.world_size = 1 + sum(ranks)
        devices = [trainer.execute_rank_zero("device_type"), *rollout.execute_all("device_type")]
        self.backend = "nccl" if set(devices) == {"cuda"} else "gloo"
        address, port = trainer.execute_rank_zero("master_address")
        join = (address, port, self.world_size, self.group_name, self.backend, self.timeout_s)
        # receivers first: an in-process trainer blocks in its call until every member has joined
        receivers = rollout.dispatch_async("engine_join_weight_group", [((*join, off), {}) for off in offsets])
        sender = trainer.execute_rank_zero_async("join_weight_broadcast", *join)
        get_together([(rollout, receivers, "engine_join_weight_group"), (trainer, sender, "join_weight_broadcast")])
        log.info("Weight broadcast group %s: %s, %d ranks (%s per replica)", self.group_name, self.backend,
                 self.world_size, ranks)

    def push(self, dtype: torch.dtype | None) -> dict[str, float]:
        """Send the weights that changed since the last sync; returns ``tensors``, ``bytes``,
        ``skipped`` and ``buckets`` (counted by the first replica)."""
        trainer, rollout = self.trainer, self.rollout
        buckets, skipped = trainer.execute_all("plan_export", dtype, True)[0]
        layouts: list[list[Entry]] = trainer.execute_rank_zero("bucket_entries") if buckets else []
        count = nbytes = 0

        def start(index: int) -> tuple[list[Any], list[Any]]:
            receivers = rollout.execute_all_async("engine_receive_bucket", layouts[index], index == buckets - 1)
            return receivers, trainer.execute_all_async("broadcast_bucket", index)

        def finish(item: tuple[list[Any], list[Any]]) -> None:
            nonlocal count, nbytes
            stats = get_together([(rollout, item[0], "engine_receive_bucket"), (trainer, item[1], "broadcast_bucket")])
            count, nbytes = count + stats[0][0]["tensors"], nbytes + stats[0][0]["bytes"]

        pipelined(len(layouts), start, finish)
        trainer.execute_all("finish_export")
        return {"tensors": count, "bytes": nbytes, "skipped": skipped, "buckets": buckets}
