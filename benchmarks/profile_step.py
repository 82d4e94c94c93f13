"""Profile one training step of a layout in one process (D = 1): where the device time goes.

    python -m benchmarks.profile_step --layout tsp --seq-len 4096
    python -m benchmarks.profile_step --layout single tsp --device cuda --dtype bfloat16 \\
        --seq-len 8192 --model '{"hidden_size": 2048, "num_attention_heads": 16}'

For each layout: the median step time (no profiler), then one profiled step with every module's
forward and every autograd node's backward as a named range. Prints, per layout, the ranges and
ops with the most device time (CPU time on a CPU run) and the kernels with the most self device
time, and how busy the device was (kernel time / step time). ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.autograd.profiler import record_function

from tsp_ext.testing.launch import run_processes

from .harness import build_model, make_batch, synchronize, train_step
from .registry import REGISTRY, TRAINING_LAYOUTS


def _named_forwards(model: torch.nn.Module) -> list:
    """Hooks that wrap each decoder block's attention, MLP and norms (and the model's head) in a
    profiler range named after the module's class."""
    handles, open_ranges = [], {}

    def enter(mod, *_):
        open_ranges[id(mod)] = rf = record_function(f"fwd:{type(mod).__name__}")
        rf.__enter__()

    def leave(mod, *_):
        open_ranges.pop(id(mod)).__exit__(None, None, None)

    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "lm_head"):
            handles += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    return handles


def _device_us(evt, self_only: bool) -> float:
    name = "self_device_time_total" if self_only else "device_time_total"
    return float(getattr(evt, name, 0.0) or 0.0)


def _profile_rank(rank: int, world: int, spec: dict) -> dict:
    """Worker: median step time of ``spec["layout"]`` and one profiled step's top ranges/ops and
    kernels."""
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, spec["dtype"])
    model = build_model(spec["model"], dtype, spec["seq_len"]).to(device)
    ids = make_batch(model.config.vocab_size, 1, spec["seq_len"]).to(device)
    prep = REGISTRY[spec["layout"]].build(model, ids, 1, device)
    opt = torch.optim.AdamW(prep.model.parameters(), lr=1e-4)
    for _ in range(2):
        train_step(prep, opt)
    times = []
    for _ in range(spec["steps"]):
        synchronize(device)
        t0 = time.perf_counter()
        train_step(prep, opt)
        synchronize(device)
        times.append(time.perf_counter() - t0)

    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    handles = _named_forwards(prep.model)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        train_step(prep, opt)
        synchronize(device)
        profiled = time.perf_counter() - t0
    for h in handles:
        h.remove()

    events = list(prof.key_averages())

    def total_ms(e):
        return (_device_us(e, False) if cuda else e.cpu_time_total) / 1e3

    # ranges and ops run on the CPU (and launch kernels); kernels have device time only
    ranges = sorted((e for e in events if e.cpu_time_total > 0), key=total_ms, reverse=True)
    kernels = [e for e in events if e.cpu_time_total == 0 and _device_us(e, True) > 0]
    kernels.sort(key=lambda e: _device_us(e, True), reverse=True)
    top = spec["top"]
    return {
        "step_ms": statistics.median(times) * 1e3,
        "profiled_step_ms": profiled * 1e3,
        "device_busy_ms": sum(_device_us(e, True) for e in kernels) / 1e3,
        "top": [
            {
                "name": e.key,
                "count": e.count,
                "total_ms": total_ms(e),
                "cpu_ms": e.cpu_time_total / 1e3,
            }
            for e in ranges[:top]
        ],
        "kernels": [
            {"name": e.key[:120], "count": e.count, "self_ms": _device_us(e, True) / 1e3}
            for e in kernels[:top]
        ],
    }


def profile(
    layout: str,
    seq_len: int,
    model_cfg: dict | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    steps: int = 3,
    top: int = 20,
    timeout: float = 600.0,
) -> dict:
    """Profile ``layout`` at D = 1 in one spawned process (gloo on CPU, NCCL on CUDA)."""
    spec = dict(
        layout=layout,
        seq_len=seq_len,
        model=model_cfg or {},
        dtype=dtype,
        device=device,
        steps=steps,
        top=top,
    )
    backend = "nccl" if device == "cuda" else "gloo"
    (res,) = run_processes(_profile_rank, 1, spec, backend=backend, timeout=timeout)
    return {"layout": layout, "seq_len": seq_len, "dtype": dtype, "device": device, **res}


def markdown(res: dict) -> str:
    cuda = res["device"] == "cuda"
    head = (
        "| range / op | calls | device ms | CPU ms |" if cuda else "| range / op | calls | CPU ms |"
    )
    lines = [
        f"### {res['layout']} S={res['seq_len']} {res['dtype']} {res['device']}: step "
        f"{res['step_ms']:.1f} ms (profiled {res['profiled_step_ms']:.1f} ms"
        + (f", device busy {res['device_busy_ms']:.1f} ms)\n" if cuda else ")\n"),
        head,
        "|---|---|---|---|" if cuda else "|---|---|---|",
    ]
    for r in res["top"]:
        cpu = f" {r['cpu_ms']:.2f} |" if cuda else ""
        lines.append(f"| {r['name'][:90]} | {r['count']} | {r['total_ms']:.2f} |{cpu}")
    if res["kernels"]:
        lines += ["", "| kernel | calls | self device ms |", "|---|---|---|"]
        lines += [
            f"| {k['name'][:90]} | {k['count']} | {k['self_ms']:.2f} |" for k in res["kernels"]
        ]
    return "\n".join(lines) + "\n\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_step", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--layout", nargs="+", default=["single", "tsp"], choices=TRAINING_LAYOUTS)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--model", type=json.loads, default={}, help="config overrides, JSON")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    for layout in args.layout:
        res = profile(layout, args.seq_len, args.model, args.dtype, args.device, top=args.top)
        sys.stdout.write(markdown(res))
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
