"""``HostStore``: saved tensors round-trip through host memory, its byte counts, the device
tier that keeps the first bytes on the device, and clear errors when host memory runs out or
the device budget cannot hold one tensor."""

from __future__ import annotations

import pytest
import torch

from tsp_ext.hf import checkpointing


def test_saved_tensors_round_trip_and_are_counted():
    store = checkpointing.HostStore()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with store.hooks():
        y = (x.sin() * x).sum()  # sin saves x; the product saves both factors
    assert store.held == store.peak == 3 * x.numel() * 8
    y.backward()
    assert torch.equal(x.grad, (x.cos() * x + x.sin()).detach())
    del y
    assert store.held == 0 and store.peak == 3 * x.numel() * 8


def test_host_memory_running_out_is_a_clear_error(monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing.tempfile, "TemporaryFile", no_space)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(MemoryError, match="host memory ran out at 128 bytes"):
        with checkpointing.HostStore().hooks():
            x.sin()


def test_device_tier_keeps_the_first_tensors_within_its_budget():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    n = x.numel() * 8
    store = checkpointing.HostStore(device_budget=2 * n + 7)  # room for two of the three
    with store.hooks():
        y = (x.sin() * x).sum()
    assert (store.device_held, store.held) == (2 * n, n)
    assert (store.device_peak, store.peak) == (2 * n, n)
    y.backward()
    assert torch.equal(x.grad, (x.cos() * x + x.sin()).detach())
    del y
    assert store.device_held == store.held == 0


def test_device_budget_below_one_tensor_is_a_clear_error():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="checkpoint_device_bytes=100 cannot hold one saved"):
        with checkpointing.HostStore(device_budget=100).hooks():
            x.sin()
