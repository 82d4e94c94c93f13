"""One rank of a D-rank TSP layout, alone, with fake tensors: per-rank memory at full scale.

``benchmarks.emulate`` runs rank r with real tensors on PyTorch's fake process group, which
limits it to what this machine's memory and time allow. Here the same training step (the
layout's ``build_tsp``, forward, backward, AdamW step) runs under ``Emulation``, a
``FakeTensorMode``: the model's weights, activations, gradients and optimizer state are fake
tensors (shapes, dtypes and strides, no storage), so an 8B model at millions of tokens takes no
memory and minutes of CPU. The peak is ``torch.distributed._tools.mem_tracker.MemTracker``'s (every
tensor storage the step creates, by category: parameters, gradients, optimizer state,
activations, temporaries), which works under fake tensors; offloaded layer inputs are counted by
the layout's ``HostStore`` (host memory, outside the peak).

Fake tensors have no values, but TSP's bookkeeping reads some: the token ids (the vocabulary-
sharded embedding exchanges row counts and row ids), the positions and labels (input checks,
per-rank agreement). ``Emulation`` therefore keeps integer data real: the batch is real, every op
whose tensor inputs are all real runs for real (on the fake group's collectives, filled by
``mirror.mirror``), and a factory op (no tensor inputs) runs for real when its result is not a
floating-point tensor of more than one element (integers, masks, optimizer step counts); all
else is fake. ``torch.equal`` of fake tensors (``rope_phases``' check of the RoPE tables, the one
check of float values on the path) answers True.

A GPU's matmuls are emulated: products of half-precision operands into a float32 result take
CUDA's path (``pointwise``: ``mm`` with ``out_dtype``, whose meta kernel fake tensors run), not
the CPU's cast-up copies (``gpu_matmuls``).

``real=True`` runs the identical code with real tensors (``mirror.Mirror`` instead of
``Emulation``): the cross-check of the fake peak at small scale (``tests/test_emulate_fake.py``).

    python -m benchmarks.emulate --fake --model llama3-8b --devices 8 --layers 32 \\
        --seq-len 4194304 --layout tsp_long --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_ext.engine.kernels import pointwise

from . import registry
from .harness import (
    DEFAULT_MODEL,
    backward_and_update,
    local_bytes,
    make_batch,
    optimizer_bytes,
    row_header,
)
from .layouts import LR
from .mirror import Mirror, mirror
from .registry import REGISTRY

_DEVICE = torch.ops.prim.device.default


def _runs_real(out) -> bool:
    """A factory op's result worth real values: no floating-point tensor of over one element."""
    return all(
        not t.is_floating_point() or t.numel() <= 1
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor)
    )


class Emulation(FakeTensorMode):
    """Fake tensors for the model's data, real ones for the integers the code reads (see the
    module docstring)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE and isinstance(args[0], FakeTensor):  # half of all calls: keep cheap
            return args[0].fake_device
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            return mirror(func, args, func(*args, **kwargs))
        if func is torch.ops.aten.equal.default:
            return True
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not tensors and _runs_real(out):
            return func(*args, **kwargs)
        return out


class PeakTracker(MemTracker):
    """``MemTracker`` keeping the global peak and its breakdown only: its per-module peaks cost
    a pass over every module per op (most of the time of a 32-layer step)."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


@contextmanager
def gpu_matmuls():
    """The engine's half-precision matmuls into float32 as on CUDA (``pointwise``'s mixed
    ``mm``) for the fake CPU tensors of the emulation, restored after."""
    saved = pointwise._MIXED_MM_DEVICES
    pointwise._MIXED_MM_DEVICES = (*saved, "cpu")
    try:
        yield
    finally:
        pointwise._MIXED_MM_DEVICES = saved


@contextmanager
def fake_group(rank: int, world: int):
    """This process as rank ``rank`` of a ``world``-rank fake process group, torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("this process has a process group already")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_model(model_cfg: dict, dtype: torch.dtype, seq_len: int) -> LlamaForCausalLM:
    """``harness.build_model``'s Llama, built in ``dtype`` (no cast: module ``.to`` cannot swap
    fake parameters)."""
    cfg = LlamaConfig(
        **{**DEFAULT_MODEL, **model_cfg},
        max_position_embeddings=seq_len,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state as after a first step (zero gradients), so the step measured is a
    steady-state one: the moments exist from its start."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _breakdown(snapshot: dict) -> dict[str, int]:
    (dev_snap,) = snapshot.values() or ({},)
    return {getattr(k, "value", k): v for k, v in dev_snap.items()}


def measure_rank(
    layout: str = "tsp",
    devices: int = 8,
    seq_len: int = 8192,
    model_cfg: dict | None = None,
    rank: int = 0,
    micro_batch: int = 1,
    dtype: str = "bfloat16",
    *,
    real: bool = False,
    tsp_options: dict | None = None,
) -> dict:
    """Rank ``rank`` of a ``devices``-rank TSP ``layout`` (a name of ``registry.REGISTRY``): one
    steady-state training step under ``MemTracker``, in this process (which must have no process
    group). ``real``: real tensors (small scales only). ``tsp_options``: ``TSPConfig`` fields
    on top of ``tsp_long``'s (e.g. the planner's choice of ``checkpoint_every``). Returns the
    row (bytes)."""
    if not layout.startswith("tsp"):
        raise ValueError(f"fake-tensor emulation runs the TSP layouts only, not {layout!r}")
    if tsp_options and layout != "tsp_long":
        raise ValueError(f"tsp_options apply to tsp_long, not {layout!r}")
    build = REGISTRY[layout].build
    if tsp_options:
        build = registry._tsp(**{**registry.TSP_LONG, **tsp_options})
    model = {**DEFAULT_MODEL, **(model_cfg or {})}
    t0 = time.perf_counter()
    tensors = (Mirror(), nullcontext()) if real else (Emulation(), gpu_matmuls())
    with fake_group(rank, devices), tensors[0], tensors[1]:
        net = build_model(model, getattr(torch, dtype), seq_len)
        ids = make_batch(net.config.vocab_size, micro_batch, seq_len)
        prep = build(net, ids, devices, torch.device("cpu"))
        del net
        opt = torch.optim.AdamW(prep.model.parameters(), lr=LR)
        _init_optimizer_state(opt)
        if prep.host_store is not None:
            prep.host_store.reset_peak()
        tracker = PeakTracker()
        tracker.track_external(prep.model, opt, ids)
        with tracker:
            local, _ = prep.loss()
            grads = backward_and_update(prep, opt, local)
            del local
        peak = tracker.get_tracker_snapshot("peak")
        memory = {
            "peak": sum(s[_TOTAL_KEY] for s in peak.values()),
            "params": local_bytes(prep.model.parameters()),
            "grads": grads,
            "optimizer": optimizer_bytes(opt),
            "host": 0 if prep.host_store is None else prep.host_store.peak,
            "peak_breakdown": _breakdown(peak),
        }
    emulated = "real" if real else "fake"
    return {
        **row_header(layout, devices, seq_len, micro_batch, dtype, model),
        "emulated": emulated,
        **({"tsp_options": tsp_options} if tsp_options else {}),
        "rank": rank,
        "status": "ok",
        "memory_bytes": memory,
        "seconds": round(time.perf_counter() - t0, 1),
    }
