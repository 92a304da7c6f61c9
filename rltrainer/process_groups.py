"""Which process group a rank's collective goes over: one whose backend takes its tensors.

A training rank's default group is NCCL on a GPU and gloo on a CPU
(:meth:`~rltrainer.rollout.worker.Worker.init_distributed`), and a group made with ``new_group()``
takes the default group's backend unless told otherwise: megatron-core's tensor-, pipeline- and
data-parallel groups do. NCCL moves CUDA tensors only (torch's ``Backend.default_device_backend_map``
maps it to ``cuda`` alone), and a CPU tensor there raises ``RuntimeError: No backend type
associated with device type cpu``. CPU runs use gloo, which takes both, so they never show it. So:

- **device tensors** (parameters, gradients, optimizer state, their slices and shards, buffers made
  on the rank's device) go over the default group or megatron-core's groups;
- **host data** (CPU tensors, pickled objects, barriers that guard host memory) goes over
  :func:`host_group`: the default group where it takes CPU tensors (gloo), else a gloo group of
  all ranks.

Object collectives (``all_gather_object``, ``broadcast_object_list``) would run on NCCL too:
torch stages their bytes on ``torch.cuda.current_device()``. Over gloo they need no device
memory, no copies between host and device, and no particular current device.

``tests/test_process_groups.py`` holds every collective in ``rltrainer/`` to this: each names its
group, or is listed there with the reason its tensors are on the rank's device.
"""

from __future__ import annotations

from typing import Any

#: name -> (the default group it was made under, a gloo group of all ranks)
_GROUPS: dict[str, tuple[Any, Any]] = {}


def takes_cpu_tensors(group: Any = None) -> bool:
    """Whether ``group`` (``None``: the default group) has a backend for CPU tensors."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    return "cpu" in BackendConfig(Backend(dist.get_backend(group))).get_device_backend_map()


def host_group(own: str | None = None) -> Any:
    """A group of all ranks for host data (CPU tensors, pickled objects, host barriers).

    ``None``, the default group, where that takes CPU tensors (gloo); else a gloo group of all
    ranks, made on the first call, which is then a collective: every rank calls it at the same
    point, as it does the collective the group is for. It is kept while the default group lives
    (a new default group in the same process gets a new one).

    ``own``: a gloo group of its own under that name, also where the default group is gloo, for
    collectives issued from another thread (a background checkpoint write), which must not
    interleave with the rank's own on one group.
    """
    import torch.distributed as dist

    world = dist.group.WORLD
    if own is None and takes_cpu_tensors():
        return None
    key = own or "host"
    made = _GROUPS.get(key)
    if made is None or made[0] is not world:
        made = _GROUPS[key] = (world, dist.new_group(backend="gloo"))
    return made[1]
