"""An accelerator on a machine without one, for tests: tensors whose bytes are in host memory but
which say they are on another device, and an account of that device's memory.

Code that branches on ``tensor.device.type == "cpu"`` takes its device path with them, and what a
GPU refuses they refuse too (``.numpy()``); ``.cpu()``, ``.to("cpu")``, a call with
``device="cpu"`` and ``copy_`` into a host tensor leave the device, as from a GPU. They report the ``meta`` device: a CPU build of torch
has no CUDA device to report (its device guards refuse one), and nothing in the library treats
``meta`` apart from any other non-CPU device. Each tensor an operation makes from them (or a
factory call with ``device=FakeDevice.device``) is on the device too, and counted:
:attr:`FakeDevice.alive` is the bytes of device storage still referenced, :attr:`FakeDevice.peak`
its highest value since :meth:`FakeDevice.reset_peak` (a caching allocator's "max allocated")::

    with FakeDevice() as device:
        new, old = device.tensor(a), device.tensor(b)
        device.reset_peak()
        changed_words(new, old, limit=100)
        extra = device.peak - device.alive_at_reset
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


class DeviceTensor(torch.Tensor):
    """A host tensor (``host``) that reports :attr:`FakeDevice.device`; operated on inside a
    :class:`FakeDevice` only."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> DeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(cls, host.shape, strides=host.stride(), dtype=host.dtype,
                                                  device=FakeDevice.device, storage_offset=host.storage_offset())
        out.host = host
        return out

    def tolist(self) -> Any:  # a copy to the host, as from a GPU (torch refuses it for subclasses)
        return self.host.tolist()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"{func} on a fake-device tensor outside its FakeDevice context")


class FakeDevice(TorchDispatchMode):
    """The context in which :class:`DeviceTensor` s are operated on (see the module docstring)."""

    device = torch.device("meta")

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[int, weakref.WeakSet]] = {}  # storage address -> (bytes, its tensors)
        self.peak = 0
        self.alive_at_reset = 0
        self.allocations: list[int] = []  # bytes of each new storage, in order

    def __enter__(self) -> FakeDevice:
        # torch.tensor(data, device=...) makes its tensor without dispatching a factory call: on the host, then moved
        self._tensor = torch.tensor
        make = self._tensor

        def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            if device is not None and torch.device(device) == self.device:
                return make(data, *args, **kwargs).to(self.device)
            return make(data, *args, device=device, **kwargs)

        torch.tensor = tensor
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.tensor = self._tensor
        super().__exit__(*exc)

    def tensor(self, host: torch.Tensor) -> DeviceTensor:
        """A copy of ``host`` on the device."""
        return self._wrap(host.detach().clone())

    @property
    def alive(self) -> int:
        for key in [k for k, (_, tensors) in self._storages.items() if not len(tensors)]:
            del self._storages[key]
        return sum(nbytes for nbytes, _ in self._storages.values())

    def reset_peak(self) -> None:
        self.peak = self.alive_at_reset = self.alive
        self.allocations.clear()

    def _wrap(self, host: torch.Tensor) -> DeviceTensor:
        out = DeviceTensor(host)
        storage = host.untyped_storage()
        key = storage.data_ptr()
        if key not in self._storages or not len(self._storages[key][1]):
            self._storages[key] = (storage.nbytes(), weakref.WeakSet())
            self.allocations.append(storage.nbytes())
        self._storages[key][1].add(out)
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        leaves = kwargs.get("device") == torch.device("cpu")  # .cpu(), empty_like(x, device="cpu"): on the host
        on_device = kwargs.get("device") == self.device
        if on_device:
            kwargs["device"] = torch.device("cpu")
        originals: dict[int, Any] = {}  # the host tensor an argument was, by id -> the argument

        def unwrap(value: Any) -> Any:
            nonlocal on_device
            if isinstance(value, DeviceTensor):
                on_device = True
                originals[id(value.host)] = value
                return value.host
            if isinstance(value, torch.Tensor):
                originals[id(value)] = value
            return value

        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        out = func(*args, **kwargs)

        def wrap(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in originals:  # an argument returned (in-place ops)
                return originals[id(value)]
            return self._wrap(value) if on_device and not leaves else value

        out = tree_map(wrap, out)
        self.peak = max(self.peak, self.alive)
        return out
