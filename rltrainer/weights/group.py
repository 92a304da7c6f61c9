"""The collective-broadcast transport's process group: trainer rank 0 broadcasts each bucket's
bytes (:mod:`rltrainer.weights.wire`) to the rollout engines' receiving processes, NCCL when every
member is on a GPU, else gloo.

The group is not the training group. Trainer rank 0 hosts a ``TCPStore`` and every member builds
its ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` directly on it, touching no ``torch.distributed``
global state, so it lives beside the training group in a trainer and beside vLLM's group in a
rollout worker. Store keys are laid out as SGLang's ``init_custom_process_group`` lays them out
(``PrefixStore(name)``, then torch's ``"{name}/"`` and ``"{device}/"`` prefixes), so SGLang's
scheduler processes join the same group through ``Engine.init_weights_update_group``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 600.0


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
        self.timeout_s = timeout_s
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
