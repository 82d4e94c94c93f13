"""Micro-benchmark of the chunked causal attention kernels on one TSP rank's zigzag queries.

    python -m benchmarks.attention_kernels
    python -m benchmarks.attention_kernels --seq-len 4096 --heads 4 --kv-heads 2 --head-dim 64 \\
        --tsp 2 --json out.json

Rank ``--rank``'s two zigzag chunks (S/D tokens) attend causally to the whole sequence (K/V in
natural order) through every backend that runs on the device and dtype; the forward and the
backward are timed separately (median of ``--repeats`` after ``--warmup``). Two reference rows time
plain ``F.scaled_dot_product_attention(is_causal=True)``: on S/D tokens attending to themselves
(the same number of queries but 1/D of a rank's query-key pairs, S^2/(2D^2) vs S^2/(2D)), and
over the whole sequence with its time divided by D (a rank's share of one device's work; on CUDA
also with each of SDPA's kernels forced: flash, memory-efficient, cuDNN). ``first ms`` is each
backend's first forward + backward on these shapes (what a new sequence length costs: cuDNN
builds its graphs there). Prints a markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tsp_ext.engine.attention.kv_exchange import heads_major
from tsp_ext.engine.kernels.backends import BACKENDS, available_backends
from tsp_ext.engine.kernels.chunked import (
    ChunkedKernel,
    chunked_attention_backward,
    chunked_attention_forward,
)
from tsp_ext.engine.sharding.layout import ZigzagLayout

log = logging.getLogger("benchmarks.attention_kernels")


def median_ms(fn: Callable[[], object], repeats: int, warmup: int, sync: Callable[[], None]):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _sdpa_row(label: str, q, k, v, dout, share: int, timer, backend=None) -> dict:
    """Causal ``F.scaled_dot_product_attention`` of ``[B, L, H, d]`` q to k, v, forward and
    backward timed like the kernels; both times divided by ``share``. GQA K/V are repeated per
    query head first (``enable_gqa`` sends float32 on CUDA to the math kernel, O(L^2) memory).
    ``backend``: an ``SDPBackend`` to force (None: SDPA's own choice)."""
    repeats, warmup, sync = timer
    g = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
    qs, ks, vs = (x.detach().transpose(1, 2) for x in (q, k, v))  # [B, H, L, d] views
    only = nullcontext if backend is None else (lambda: sdpa_kernel([backend]))

    def sdpa(grad: bool):
        with torch.set_grad_enabled(grad), only():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    fwd = median_ms(lambda: sdpa(False), repeats, warmup, sync)
    for x in (qs, ks, vs):
        x.requires_grad_()
    bwd_times = []
    for i in range(warmup + repeats):
        o = sdpa(True)  # each backward needs a fresh graph; the forward is not timed
        sync()
        t0 = time.perf_counter()
        torch.autograd.grad(o, (qs, ks, vs), dout.transpose(1, 2))
        sync()
        if i >= warmup:
            bwd_times.append((time.perf_counter() - t0) * 1e3)
    return {
        "kernel": label,
        "fwd_ms": fwd / share,
        "bwd_ms": statistics.median(bwd_times) / share,
        "max_abs_diff": None,
        "grad_max_abs_diff": None,
    }


def bench(
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tsp: int,
    rank: int = 0,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 1,
) -> list[dict]:
    """One row per backend (and the SDPA reference): ``fwd_ms``, ``bwd_ms``, ratios to blockwise,
    and ``max_abs_diff`` / ``grad_max_abs_diff`` of the output / of dq, dk, dv against blockwise."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timer = (repeats, warmup, sync)
    spans = ZigzagLayout(seq_len, tsp).spans(rank)
    T, scale = seq_len // tsp, head_dim**-0.5
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    # heads-major storage, as the TSP schedule hands them to the kernels
    q, dout = (heads_major(rand(batch, T, heads, head_dim)) for _ in "qo")
    k, v = (heads_major(rand(batch, seq_len, kv_heads, head_dim)) for _ in "kv")

    kernels = [(n, BACKENDS[n]) for n in ["blockwise", *available_backends(dev, dtype)]]
    kernels = list(dict(kernels).items())  # blockwise once, first: the reference
    rows, ref = [], {}
    for name, kernel in kernels:
        kern = ChunkedKernel(kernel, scale)
        try:
            sync()
            t0 = time.perf_counter()
            out, lse = chunked_attention_forward(kern, q, spans, (k, v))
            grads = chunked_attention_backward(kern, dout, q, spans, kv=(k, v), fwd=(out, lse))
            sync()
            first = (time.perf_counter() - t0) * 1e3
        except RuntimeError as e:  # a fused op refused these inputs (head size, GPU)
            log.info("%s: %s", name, str(e).splitlines()[0])
            continue
        ref = ref or {"out": out, "grads": grads}
        fwd = median_ms(lambda kern=kern: chunked_attention_forward(kern, q, spans, (k, v)), *timer)
        bwd = median_ms(
            lambda kern=kern, out=out, lse=lse: chunked_attention_backward(
                kern, dout, q, spans, kv=(k, v), fwd=(out, lse)
            ),
            *timer,
        )
        diff = (out.float() - ref["out"].float()).abs().max().item()
        gdiff = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref["grads"]))
        rows.append(
            {
                "kernel": name,
                "fwd_ms": fwd,
                "bwd_ms": bwd,
                "first_ms": first,
                "max_abs_diff": diff,
                "grad_max_abs_diff": gdiff,
            }
        )

    # References through SDPA's autograd: causal self-attention of the rank's S/D tokens, and
    # causal attention over the whole sequence divided by D (a rank's share of the work).
    rows.append(_sdpa_row(f"sdpa causal self T={T}", q, k[:, :T], v[:, :T], dout, 1, timer))
    k_all = heads_major(rand(batch, seq_len, heads, head_dim))
    rows.append(_sdpa_row(f"sdpa causal S={seq_len} / D", k_all, k, v, k_all, tsp, timer))
    if dev.type == "cuda":  # which of SDPA's kernels sets that pace: each one forced in turn
        for b in (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
        ):
            label = f"sdpa {b.name.lower()} causal S={seq_len} / D"
            try:
                rows.append(_sdpa_row(label, k_all, k, v, k_all, tsp, timer, b))
            except RuntimeError as e:  # this kernel does not take the dtype / shape here
                log.info("%s: %s", label, str(e).splitlines()[0])
    base = rows[0]
    for r in rows:
        r["fwd_vs_blockwise"] = r["fwd_ms"] / base["fwd_ms"]
        r["bwd_vs_blockwise"] = r["bwd_ms"] / base["bwd_ms"]
        r.update(
            seq_len=seq_len,
            tsp=tsp,
            rank=rank,
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=str(dtype).removeprefix("torch."),
            device=device,
            threads=torch.get_num_threads(),
        )
    return rows


def fmt(x: float | None, spec: str = ".1e") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (
        f"S={r0['seq_len']} D={r0['tsp']} rank={r0['rank']} B={r0['batch']} "
        f"Hq={r0['heads']} Hk={r0['kv_heads']} d={r0['head_dim']} {r0['dtype']} "
        f"{r0['device']} threads={r0['threads']}\n\n"
        "| kernel | fwd ms | bwd ms | fwd / blockwise | bwd / blockwise | first ms | max abs diff "
        "| grad max abs diff |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['kernel']} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['fwd_vs_blockwise']:.3f} "
        f"| {r['bwd_vs_blockwise']:.3f} | {fmt(r.get('first_ms'), '.1f')} "
        f"| {fmt(r['max_abs_diff'])} | {fmt(r['grad_max_abs_diff'])} |\n"
        for r in rows
    ]
    return head + "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tsp", type=int, default=2, help="TSP axis size D")
    ap.add_argument("--rank", type=int, default=0, help="whose zigzag chunks are the queries")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = bench(
        args.seq_len,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.tsp,
        rank=args.rank,
        batch=args.batch,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    sys.stdout.write(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        log.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
