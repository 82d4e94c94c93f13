"""``HostStore``: saved tensors round-trip through host memory, its byte counts, and a clear
error when host memory runs out."""

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
