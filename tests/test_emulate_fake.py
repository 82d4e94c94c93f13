"""Fake-tensor emulation of one TSP rank (``benchmarks.emulate_fake``): its MemTracker peak
equals the same step's with real tensors (its linearity in S at Llama-3-8B scale:
``tests/test_plan_longest.py``).

Both run in this process, on a fake process group of D = 4 (no processes to start).
"""

from __future__ import annotations

import pytest

from benchmarks.emulate_fake import measure_rank
from tsp_ext.planner import PRESETS

TINY = PRESETS["tiny"].hf_config_kwargs()  # 2 layers, h = 256, V = 2048


def test_fake_peak_matches_real_tensors():
    """``tsp_long`` (the configuration docs/benchmarks.md emulates at 8B) at D = 4: the same
    peak, state and host bytes with fake tensors as with real ones; the layer inputs went to
    host memory, counted, not written. In float32: in half precision the emulation takes a
    GPU's matmuls into float32 (``gpu_matmuls``), which the CPU's real tensors cannot."""
    real = measure_rank("tsp_long", 4, 2048, TINY, dtype="float32", real=True)["memory_bytes"]
    fake = measure_rank("tsp_long", 4, 2048, TINY, dtype="float32")["memory_bytes"]
    for key in ("peak", "params", "grads", "optimizer", "host"):  # to the byte
        assert fake[key] == real[key], key
    assert fake["host"] == 2 * 2048 // 4 * TINY["hidden_size"] * 4  # 2 layers, float32


@pytest.mark.multiproc
def test_real_tensor_emulation_runs_one_rank():
    """``benchmarks.emulate`` (real tensors, one rank spawned on the fake group): the state of
    rank 0 of TSP at D = 4 is a quarter of the tiny model's layer weights and its vocabulary."""
    from benchmarks.emulate import emulate

    row = emulate("tsp", 4, 256, TINY)
    assert row["status"] == "ok" and row["emulated"] and row["loss"] is None
    mem = row["memory_bytes"]
    assert mem["params"] == mem["grads"]
    assert 0 <= mem["optimizer"] - 2 * mem["params"] < 1024  # two moments (and step counts)
    assert mem["activations"] > 0
