"""Measure one training step (forward + backward + AdamW step) of one layout, per rank.

``measure(layout, devices, seq_len, model_cfg)`` launches ``devices`` processes (gloo on CPU;
NCCL with ``device="cuda"``, one GPU per rank), builds the same Llama from its config on every
rank (seeded, nothing downloaded), parallelises it with the layout's library and returns one row:

- ``memory_bytes``: ``params`` (QLoRA: with its NF4-packed base), ``grads``, ``optimizer``
  (local storage, DTensor shards included), ``activations`` (saved for backward, parameters
  excluded), ``peak`` (CPU: the peak resident set, VmHWM, reset at the start of the step; CUDA:
  ``torch.cuda.max_memory_allocated``) and ``peak_delta`` (peak minus the memory held when the
  step started), ``host`` (offloaded layer checkpoints: the peak bytes in host memory, outside
  ``peak``), ``resident_grads`` (gradient buffers that outlive the step, inside neither
  ``peak_delta`` nor the state: ZeRO-3's);
- ``comm_bytes``: bytes received per collective type in one step (see ``comm_counter``);
- ``step_seconds`` (median over ``steps`` uninstrumented steps after ``warmup``), ``tokens_per_s``;
- ``loss``: the global loss of the first step (same weights everywhere, so every layout must agree
  with ``single``) and ``final_loss`` after the last step (agreement checks the gradients too).

Values are the max over ranks. Step order: ``warmup`` steps (the first gives ``loss``), ``steps``
timed steps (the allocator as every user has it), then one instrumented step (memory, saved bytes,
communication) with glibc switched to mmap every allocation over 64 KiB, so that freed tensors
leave the resident set at once and the peak RSS tracks live memory rather than the allocator's
cache. That setting makes each large allocation page-fault afresh, which would slow
allocation-heavy layouts unequally, so it is never on while timing.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_ext.hf.nf4 import NF4Linear
from tsp_ext.memory import SavedTensorBytes
from tsp_ext.planner import PRESETS
from tsp_ext.testing.launch import run_processes

from .comm_counter import CommCounter
from .layouts import LR, Prepared
from .registry import REGISTRY, lookup, tp_sp_split

# a small Llama every layout divides at D in {2, 4}: heads 8 / D, KV heads 4 / D, MLP 704 / D
DEFAULT_MODEL = PRESETS["tiny"].hf_config_kwargs()
MODEL_KEYS = tuple(DEFAULT_MODEL)


def build_model(
    model_cfg: dict, dtype: torch.dtype, seq_len: int, seed: int = 0
) -> LlamaForCausalLM:
    """The benchmark Llama from its config: the same weights on every rank (fixed seed)."""
    if "model_type" in model_cfg and model_cfg["model_type"] not in ("llama", "qwen3"):
        raise ValueError(
            f"the benchmark harness builds dense Llama-family models, not {model_cfg['model_type']}"
            " (mixture of experts: python -m benchmarks.moe)"
        )
    cfg = LlamaConfig(
        **{**DEFAULT_MODEL, **model_cfg},
        max_position_embeddings=seq_len,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype)


def make_batch(vocab: int, micro_batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    """Token ids ``[micro_batch, seq_len]``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (micro_batch, seq_len), generator=g)


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_now(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes("VmRSS")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _rss_bytes("VmHWM")


def mmap_large_allocations() -> None:
    """glibc: from now on serve every allocation over 64 KiB by mmap, and return cached free
    memory to the system (CPU peak-RSS measurements only; no effect elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the peak includes the allocator's cache
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.malloc_trim(0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _weights(model) -> list[torch.Tensor]:
    """The tensors holding a model's weights: its parameters, and QLoRA's NF4-packed base."""
    packed = [m.packed for m in model.modules() if isinstance(m, NF4Linear)]
    return [*model.parameters(), *packed]


def _state_bytes(prep: Prepared, opt) -> tuple[int, int]:
    """(parameters, optimizer state) this rank stores: under a ZeRO-3 engine its partitions
    (``ds_tensor``) and the engine's fp32 partitions and moments."""
    if prep.deepspeed_engine is None:
        return local_bytes(_weights(prep.model)), optimizer_bytes(opt)
    params = local_bytes(getattr(p, "ds_tensor", p) for p in prep.model.parameters())
    zero = prep.deepspeed_engine.optimizer
    masters = getattr(zero, "fp32_partitioned_groups_flat", [])
    return params, optimizer_bytes(zero.optimizer) + local_bytes(masters)


def backward_and_update(prep: Prepared, opt, local: torch.Tensor) -> int:
    """Backward of ``local``, the layout's gradient sums, the update; returns gradient bytes."""
    if prep.deepspeed_engine is not None:
        prep.deepspeed_engine.backward(local)
        flat = getattr(prep.deepspeed_engine.optimizer, "grad_partitions_flat_buffer", None)
        grads = 0 if flat is None else local_bytes([flat])  # ZeRO-3's gradient partitions
        prep.deepspeed_engine.step()
        return grads
    local.backward()
    prep.reduce_grads()
    grads = local_bytes(p.grad for p in prep.model.parameters() if p.grad is not None)
    opt.step()
    return grads


def train_step(prep: Prepared, opt) -> float:
    """One training step; returns the global loss."""
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    with prep.context():
        local, total = prep.loss()
        backward_and_update(prep, opt, local)
    return float(total)


def _instrumented_step(prep: Prepared, opt, device) -> dict:
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    gc.collect()
    base = memory_now(device)
    reset_peak(device)
    if prep.host_store is not None:
        prep.host_store.reset_peak()
    with CommCounter() as comm:
        with prep.context():
            with SavedTensorBytes(ignore=_weights(prep.model)) as saved:
                local, _ = prep.loss()
            grads = backward_and_update(prep, opt, local)
            del local
    synchronize(device)
    peak = peak_memory(device)
    params, optimizer = _state_bytes(prep, opt)
    return {
        "memory_bytes": {
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "activations": saved.nbytes,
            "peak": peak,
            "peak_delta": peak - base,
            "host": 0 if prep.host_store is None else prep.host_store.peak,
            "resident_grads": grads if prep.deepspeed_engine is not None else 0,
        },
        "comm_bytes": dict(comm.received),
    }


def _is_oom(e: BaseException) -> bool:
    msg = str(e)
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        "out of memory" in msg or "can't allocate memory" in msg
    )


def train_rank(rank: int, world: int, spec: dict) -> dict:
    """Worker: build the layout on this rank and measure it (``spec``: measure's arguments)."""
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, spec["dtype"])
    try:
        model = build_model(spec["model"], dtype, spec["seq_len"]).to(device)
        ids = make_batch(model.config.vocab_size, spec["micro_batch"], spec["seq_len"]).to(device)
        if spec["release_from_start"] and device.type == "cpu":
            mmap_large_allocations()
        prep = REGISTRY[spec["layout"]].build(model, ids, world, device)
        del model
        opt = None if prep.deepspeed_engine else torch.optim.AdamW(prep.model.parameters(), lr=LR)
        first = train_step(prep, opt)
        for _ in range(spec["warmup"] - 1):
            train_step(prep, opt)
        times = []
        for _ in range(spec["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            last = train_step(prep, opt)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        if device.type == "cpu":
            mmap_large_allocations()
        row = _instrumented_step(prep, opt, device)
    except NotImplementedError as e:  # the layout's library refuses this device or model
        return {"status": f"unsupported: {type(e).__name__}: {e}"}
    except Exception as e:
        if _is_oom(e):
            return {"status": "oom"}
        raise
    return {**row, "status": "ok", "loss": first, "final_loss": last, "times": times}


def _merge(results: list[dict]) -> dict:
    """Max over ranks of every byte count and of the per-rank median step time."""
    if any(r["status"] != "ok" for r in results):
        return {"status": next(r["status"] for r in results if r["status"] != "ok")}
    mem = {k: max(r["memory_bytes"][k] for r in results) for k in results[0]["memory_bytes"]}
    kinds = sorted({k for r in results for k in r["comm_bytes"]})
    comm = {k: max(r["comm_bytes"].get(k, 0) for r in results) for k in kinds}
    return {
        "status": "ok",
        "memory_bytes": mem,
        "comm_bytes": comm,
        "step_seconds": max(statistics.median(r["times"]) for r in results),
        "loss": results[0]["loss"],
        "final_loss": results[0]["final_loss"],
    }


def row_header(
    layout: str, devices: int, seq_len: int, micro_batch: int, dtype: str, model: dict
) -> dict:
    """What identifies a row: the layout and its (tp, sp) split, the shape, the model's sizes."""
    tp, sp = tp_sp_split(layout, devices)
    return {
        "layout": layout,
        "tp": tp,
        "sp": sp,
        "devices": devices,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "dtype": dtype,
        "model": {k: model[k] for k in MODEL_KEYS},
    }


def measure(
    layout: str,
    devices: int,
    seq_len: int,
    model_cfg: dict | None = None,
    micro_batch: int = 1,
    steps: int = 5,
    warmup: int = 1,
    dtype: str = "float32",
    *,
    device: str = "cpu",
    timeout: float = 1800.0,
    launch: Callable | None = None,
    release_from_start: bool = False,
) -> dict:
    """Measure one layout at one sequence length; returns a result row (see the module docstring).

    ``layout="single"`` (and ``"dpo_single"``) always runs one process (``devices`` is ignored,
    the row says 1).
    ``device="cuda"`` runs NCCL with one GPU per rank. A run that dies for memory gives
    ``status="oom"``; a layout that cannot be built here, ``status="unsupported: <reason>"``.
    ``launch(fn, world, *args, timeout=...)`` runs the ranks (default: fresh gloo / NCCL
    processes, ``run_processes``, which a ``process_wide`` layout always gets; the tests
    pass their kept pool, whose ranks' peak resident set is not their own: use its rows' tensor
    byte counts, not ``peak``). ``release_from_start``: glibc returns freed memory from process
    start, not only in the instrumented step (memory searches: memory freed by the first steps
    does not stay resident; it slows allocation, so never for timings).
    """
    if warmup < 1 or steps < 1:
        raise ValueError(f"need warmup >= 1 and steps >= 1, got warmup={warmup}, steps={steps}")
    model = {**DEFAULT_MODEL, **(model_cfg or {})}
    entry = lookup(layout)
    world = entry.ranks(devices)
    row = row_header(layout, world, seq_len, micro_batch, dtype, model)
    reason = unsupported_reason(layout, device)
    if reason:
        return {**row, "status": f"unsupported: {reason}"}
    spec = dict(
        layout=layout,
        seq_len=seq_len,
        model=model,
        micro_batch=micro_batch,
        steps=steps,
        warmup=warmup,
        dtype=dtype,
        device=device,
        release_from_start=release_from_start,
    )
    backend = "nccl" if device == "cuda" else "gloo"
    if launch is None or entry.process_wide:  # those need processes of their own
        launch = functools.partial(run_processes, backend=backend)
    try:
        results = launch(train_rank, world, spec, timeout=timeout)
    except RuntimeError as e:
        if "exit code -9" in str(e):  # the kernel's OOM killer
            return {**row, "status": "oom"}
        raise
    merged = _merge(results)
    if merged["status"] == "ok":
        merged["tokens_per_s"] = micro_batch * seq_len / merged["step_seconds"]
    return {**row, **merged}


def unsupported_reason(layout: str, device: str) -> str | None:
    """Why ``layout`` cannot run on ``device`` with the installed libraries, or None.

    Ring attention (torch ``context_parallel``) swaps SDPA for a ring schedule through DTensor
    sharding rules registered for the CUDA kernels only; CPU SDPA dispatches
    ``aten._scaled_dot_product_flash_attention_for_cpu``, so it needs a rule for that op.
    """
    if layout == "ring" and device == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        prop = DTensor._op_dispatcher.sharding_propagator
        if op not in prop.op_strategy_funcs and op not in prop.op_to_rules:
            return (
                "torch context_parallel has no CPU SDPA kernel: DTensor has no sharding strategy "
                f"for {op} (context_parallel handles the CUDA flash/efficient/cudnn kernels only)"
            )
    return None
