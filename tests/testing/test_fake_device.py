"""The stand-in device the weight-sync tests imitate a GPU with: its tensors take the device path
and refuse what a GPU's refuse, leave it as a GPU's do, and it counts the storage it holds."""

from __future__ import annotations

import pytest
import torch

from rltrainer.testing.fake_device import DeviceTensor, FakeDevice


def test_a_fake_device_tensor_acts_as_a_gpus_and_its_memory_is_counted():
    with FakeDevice() as device:
        x = device.tensor(torch.arange(1024, dtype=torch.int32))
        assert x.device.type != "cpu" and device.alive == 4096
        with pytest.raises(Exception):
            x.numpy()  # as from a GPU
        device.reset_peak()
        view = x[:512]  # no new storage
        doubled = x * 2  # 4 KiB more
        assert isinstance(view, DeviceTensor) and isinstance(doubled, DeviceTensor) and device.alive == 8192
        del doubled
        assert device.alive == 4096 and device.peak - device.alive_at_reset == 4096
        host = [x.cpu(), torch.empty_like(x, device="cpu"), torch.empty(1024, dtype=torch.int32).copy_(x)]
        assert not any(isinstance(t, DeviceTensor) for t in host) and torch.equal(host[0], torch.arange(1024))
        made = torch.tensor([1, 2, 3], device=FakeDevice.device)  # a factory call onto the device
        assert isinstance(made, DeviceTensor) and made.tolist() == [1, 2, 3] and int(view.sum()) == 130816
