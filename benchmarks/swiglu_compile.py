"""Eager vs ``torch.compile`` of the SwiGLU backward's elementwise block on one TSP rank's shard.

    python -m benchmarks.swiglu_compile --seq-len 4096 --tsp 2 --intermediate 704 --json out.json

Times ``tsp_ext.engine.feed_forward.mlp.swiglu_pointwise_backward`` (silu, its derivative and the
products: ``dM`` and the gate/up pre-activations in, ``[dG | dU]`` over them and the activation
out) on S/D tokens and one MLP shard of F/D columns, as the engine runs it and compiled by inductor
(median of ``--repeats``; the first compiled call, compilation included, reported apart). Prints
a markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from tsp_ext.engine.feed_forward.mlp import swiglu_pointwise_backward


def _median_ms(fn, reset, repeats: int) -> float:
    """Median time of ``fn()``, ``reset()`` (untimed) before each call."""
    times = []
    for _ in range(repeats):
        reset()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(tokens: int, columns: int, dtype: torch.dtype, device: str, repeats: int) -> list[dict]:
    """One row per variant: eager and compiled, on ``[1, tokens, columns]`` shards."""
    gen = torch.Generator(device=device).manual_seed(0)
    dm = torch.randn(1, tokens, columns, dtype=dtype, device=device, generator=gen)
    hid = torch.randn(1, tokens, 2 * columns, dtype=dtype, device=device, generator=gen)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    # dM and the pre-activations are overwritten: every call gets the same values (untimed copy)
    work_dm, work_hid = dm.clone(), hid.clone()

    def reset():
        work_dm.copy_(dm)
        work_hid.copy_(hid)
        sync()

    def run(fn):
        out = fn(work_dm, work_hid)
        sync()
        return out

    compiled = torch.compile(swiglu_pointwise_backward, dynamic=False)
    reset()
    t0 = time.perf_counter()
    first = [t.clone() for t in run(compiled)]
    compile_s = time.perf_counter() - t0
    reset()
    ref = run(swiglu_pointwise_backward)
    diff = max((a - b).abs().max().item() for a, b in zip(first, ref))
    rows = []
    for name, fn, extra in (
        ("eager", swiglu_pointwise_backward, {}),
        ("compiled", compiled, {"first_call_s": round(compile_s, 2), "max_abs_diff": diff}),
    ):
        ms = _median_ms(lambda fn=fn: run(fn), reset, repeats)
        rows.append({"variant": name, "tokens": tokens, "columns": columns, "ms": ms, **extra})
    return rows


def markdown_table(rows: list[dict]) -> str:
    eager = rows[0]["ms"]
    out = ["| variant | tokens | columns | ms | / eager | first call s | max abs diff |"]
    out.append("|---|---|---|---|---|---|---|")
    for r in rows:
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else ""
        out.append(
            f"| {r['variant']} | {r['tokens']} | {r['columns']} | {r['ms']:.2f} | "
            f"{r['ms'] / eager:.2f} | {r.get('first_call_s', '')} | {diff} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--tsp", type=int, default=2, help="TSP axis size D")
    ap.add_argument("--intermediate", type=int, default=704, help="MLP width F")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = bench(
        args.seq_len // args.tsp,
        args.intermediate // args.tsp,
        getattr(torch, args.dtype),
        args.device,
        args.repeats,
    )
    sys.stdout.write(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
