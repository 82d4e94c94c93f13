"""Packed documents vs one causal stream of the same total length: one TSP rank's attention.

    python -m benchmarks.packed
    python -m benchmarks.packed --seq-len 16384 --tsp 2 --doc-lens 128 1024 4096 --json out.json

Rank ``--rank``'s zigzag queries attend to the whole sequence (K/V in natural order, stored
heads-major as the TSP schedule hands them to the kernels); forward and backward are timed
separately (median of ``--repeats`` after ``--warmup``). Rows:

- ``stream``: one causal stream (per chunk, a prefix call and a causal diagonal call);
- ``split``: the row packed with documents of ``--doc-lens`` tokens; each chunk cut where a
  document starts, each piece one prefix call from its document's first key and one causal
  diagonal call (``engine.sharding.documents``: what a TSP model runs);
- ``masked``: the masked alternative: per chunk, one SDPA call over the keys of the chunk's
  documents with the explicit block-diagonal causal mask (backward through SDPA's autograd).

Prints a markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.attention_kernels import fmt, median_ms
from tsp_ext.engine.attention.kv_exchange import heads_major
from tsp_ext.engine.kernels.backends import select_backend
from tsp_ext.engine.kernels.chunked import (
    ChunkedKernel,
    chunked_attention_backward,
    chunked_attention_forward,
)
from tsp_ext.engine.sharding.documents import query_spans
from tsp_ext.engine.sharding.layout import ZigzagLayout

log = logging.getLogger("benchmarks.packed")


def doc_positions(seq_len: int, doc_len: int) -> torch.Tensor:
    """``[1, seq_len]`` position ids of documents of ``doc_len`` tokens (the last one shorter)."""
    return (torch.arange(seq_len) % doc_len)[None]


def _masked(q, k, v, lay: ZigzagLayout, rank: int, pos: torch.Tensor, scale: float):
    """Per local chunk: keys from the first key of its first document, explicit mask."""
    g = lay.positions(rank)
    doc = (pos[0] == 0).cumsum(0)  # document index of every global position
    calls = []
    for s in lay.spans(rank):
        k0 = s.start - int(pos[0, s.start])
        rows = slice(s.offset, s.offset + s.length)
        qpos = g[rows]
        kpos = torch.arange(k0, s.stop)
        mask = (kpos[None] <= qpos[:, None]) & (doc[kpos][None] == doc[qpos][:, None])
        calls.append((rows, slice(k0, s.stop), mask.to(q.device)))

    def run(grad: bool):
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, L, d] views
        with torch.set_grad_enabled(grad):
            outs = [
                F.scaled_dot_product_attention(
                    qs[:, :, r], ks[:, :, kr], vs[:, :, kr], m, scale=scale, enable_gqa=True
                )
                for r, kr, m in calls
            ]
        return torch.cat(outs, dim=2).transpose(1, 2)

    return run


def bench(
    seq_len: int,
    doc_lens: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    tsp: int = 2,
    rank: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    kernel: str = "auto",
    repeats: int = 5,
    warmup: int = 1,
) -> list[dict]:
    """Rows ``stream``, then ``split`` and ``masked`` per document length: ``fwd_ms``,
    ``bwd_ms``, ratios to the stream, kernel ``calls`` and ``max_abs_diff`` (split vs masked)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    lay = ZigzagLayout(seq_len, tsp)
    backend = select_backend(kernel, dev, dtype)
    T, scale = seq_len // tsp, head_dim**-0.5
    kern = ChunkedKernel(backend, scale)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return heads_major(torch.randn(*shape, generator=gen).to(dev, dtype))

    q, dout = rand(1, T, heads, head_dim), rand(1, T, heads, head_dim)
    k, v = rand(1, seq_len, kv_heads, head_dim), rand(1, seq_len, kv_heads, head_dim)

    def timed_chunked(spans) -> tuple[float, float, torch.Tensor]:
        out, lse = chunked_attention_forward(kern, q, spans, (k, v))
        fwd = median_ms(
            lambda: chunked_attention_forward(kern, q, spans, (k, v)), repeats, warmup, sync
        )
        bwd = median_ms(
            lambda: chunked_attention_backward(kern, dout, q, spans, kv=(k, v), fwd=(out, lse)),
            repeats,
            warmup,
            sync,
        )
        return fwd, bwd, out

    def timed_masked(run) -> tuple[float, float, torch.Tensor]:
        fwd = median_ms(lambda: run(False), repeats, warmup, sync)
        for x in (q, k, v):
            x.requires_grad_()
        times = []
        for i in range(warmup + repeats):
            o = run(True)  # a fresh graph per backward; the forward is not timed
            sync()
            t0 = time.perf_counter()
            torch.autograd.grad(o, (q, k, v), dout)
            sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        for x in (q, k, v):
            x.requires_grad_(False)
        return fwd, statistics.median(times), run(False)

    fwd, bwd, _ = timed_chunked(lay.spans(rank))
    rows = [{"docs": "one stream", "method": "stream", "fwd_ms": fwd, "bwd_ms": bwd, "calls": 4}]
    rows[0]["max_abs_diff"] = None
    for n in doc_lens:
        pos = doc_positions(seq_len, n)
        spans = query_spans(lay.shard(pos, rank), lay, rank)
        fwd, bwd, split = timed_chunked(spans)
        calls = sum(1 + (s.start > s.first_key) for s in spans)
        rows.append({"docs": n, "method": "split", "fwd_ms": fwd, "bwd_ms": bwd, "calls": calls})
        fwd, bwd, masked = timed_masked(_masked(q, k, v, lay, rank, pos, scale))
        diff = (split.float() - masked.float()).abs().max().item()
        rows.append({"docs": n, "method": "masked", "fwd_ms": fwd, "bwd_ms": bwd, "calls": 2})
        rows[-2]["max_abs_diff"] = rows[-1]["max_abs_diff"] = diff
    for r in rows:
        r.update(
            fwd_vs_stream=r["fwd_ms"] / rows[0]["fwd_ms"],
            bwd_vs_stream=r["bwd_ms"] / rows[0]["bwd_ms"],
            seq_len=seq_len,
            tsp=tsp,
            rank=rank,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            kernel=backend.name,
            dtype=str(dtype).removeprefix("torch."),
            device=device,
            threads=torch.get_num_threads(),
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    r0 = rows[0]
    head = (
        f"S={r0['seq_len']} D={r0['tsp']} rank={r0['rank']} Hq={r0['heads']} Hk={r0['kv_heads']} "
        f"d={r0['head_dim']} {r0['dtype']} {r0['device']} kernel={r0['kernel']} "
        f"threads={r0['threads']}\n\n"
        "| document length | method | calls | fwd ms | bwd ms | fwd / stream | bwd / stream "
        "| max abs diff |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['docs']} | {r['method']} | {r['calls']} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} "
        f"| {r['fwd_vs_stream']:.3f} | {r['bwd_vs_stream']:.3f} | {fmt(r['max_abs_diff'])} |\n"
        for r in rows
    ]
    return head + "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--doc-lens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tsp", type=int, default=2, help="TSP axis size D")
    ap.add_argument("--rank", type=int, default=0, help="whose zigzag chunks are the queries")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--kernel", default="auto", help="attention backend of stream and split")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = bench(
        args.seq_len,
        args.doc_lens,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.tsp,
        rank=args.rank,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        kernel=args.kernel,
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
