"""NCCL's device rule on a CPU: a default process group that refuses CPU tensors, as NCCL does.

On a GPU a training rank's default group is NCCL, which moves CUDA tensors only: a CPU tensor in
one of its collectives raises ``RuntimeError: No backend type associated with device type cpu``.
CPU runs use gloo, which takes both, so a collective over host data on the default group passes
CPU CI and fails on the first GPU run. Inside :func:`nccl_rule` (this process only: a run of one
rank, in the test's process, or ranks a test starts itself):

- the default group is made with backend ``"cuda:gloo"``: gloo for CUDA tensors only, so a CPU
  tensor in a tensor collective on it raises torch's own error, as under NCCL;
- a group made with ``new_group()`` and no backend (megatron-core's tensor-, pipeline- and
  data-parallel groups) is gloo: on a GPU it is NCCL and carries the rank's device tensors, which
  on a CPU are CPU tensors;
- object collectives and barriers on the default group run over a gloo group of their own, as
  NCCL runs them (torch stages an object's bytes on the current CUDA device, which a CUDA-less
  torch cannot).

What it cannot tell: a host tensor on one of those ``new_group()`` groups, where on a CPU the
rank's device tensors are CPU tensors too (``tests/test_process_groups.py`` checks statically that
every collective names its group or is listed with its reason).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

#: The collectives that carry objects, or no tensor of the caller's: NCCL runs them on the default group.
PASSING = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "barrier")


@contextlib.contextmanager
def nccl_rule() -> Iterator[None]:
    """Within: process groups made in this process follow NCCL's device rule (see the module)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    originals = {name: getattr(c10d, name) for name in ("init_process_group", "new_group", *PASSING)}
    standins: dict[int, tuple[Any, Any]] = {}  # id(default group) -> (it, the gloo group its object collectives use)

    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"nccl_rule() imitates an NCCL default group; init_process_group got backend={backend!r}")
        originals["init_process_group"]("cuda:gloo", *args, **kwargs)

    new_group_signature = inspect.signature(originals["new_group"])

    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = new_group_signature.bind(*args, **kwargs)
        if bound.arguments.get("backend") is None:
            bound.arguments["backend"] = "gloo"
        return originals["new_group"](*bound.args, **bound.kwargs)

    def standin() -> Any:
        world = c10d.group.WORLD
        made = standins.get(id(world))
        if made is None or made[0] is not world:
            made = standins[id(world)] = (world, originals["new_group"](backend="gloo"))
        return made[1]

    def passing(name: str) -> Any:
        function = originals[name]
        signature = inspect.signature(function)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if bound.arguments.get("group") in (None, c10d.group.WORLD):
                bound.arguments["group"] = standin()
            return function(*bound.args, **bound.kwargs)

        return call

    patched = {"init_process_group": init_process_group, "new_group": new_group,
               **{name: passing(name) for name in PASSING}}
    try:
        for name, function in patched.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
        yield
    finally:
        for name, function in originals.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
