"""Sliding-window attention layer under TSP: the window exchange against the full K/V all-gather.

    python -m benchmarks.window                       # W = 512, S = 8W, D = 2 and 4
    python -m benchmarks.window --window 256 --json docs/benchmarks/window_cpu.json

One ``TSPAttention`` layer of a Mistral-style model (h 512, 8 query / 4 KV heads of 64, fp32,
batch 1) with ``sliding_window = W`` at S = 8W, forward + backward on this rank's tokens, in two
modes of one run: ``window`` (``TSPConfig(window_exchange=True)``: each rank receives only the
keys its queries see, ``engine.attention.window``) and ``all-gather`` (``window_exchange=False``:
every key, as a full-attention layer). The attention computed is the same (windowed kernels); only
the K/V traffic and the gathered K/V differ.

Per row: K/V bytes received per rank in forward (the gather) and backward (dK/dV going home),
counted at the dispatcher by ``benchmarks.comm_counter`` (max over ranks; weight broadcasts and
reductions are the same in both modes and left out; with D <= KV heads no KV head is shared, so
every point-to-point byte is K/V), the K/V tokens a rank holds per head group,
and the step time (median of ``--steps`` after one warm-up, max over ranks) with its ratio to
the all-gather's at the same D. Prints a markdown table; ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import MistralConfig, MistralForCausalLM

from benchmarks.comm_counter import CommCounter
from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh
from tsp_ext.engine.attention.window import WindowExchange
from tsp_ext.engine.sharding.layout import ZigzagLayout

MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_hidden_layers=1,
    vocab_size=256,
)
KV_KINDS = {"all_gather", "all_to_all", "reduce_scatter", "send_recv"}


def _kv_bytes(counter: CommCounter) -> int:
    return sum(n for kind, n in counter.received.items() if kind in KV_KINDS)


def _worker(rank, world, window, seq, steps):
    torch.set_num_threads(1)

    def config():  # apply_tsp marks the config it was given as a TSP model's
        return MistralConfig(**MODEL, sliding_window=window, max_position_embeddings=seq)

    cfg = config()
    torch.manual_seed(0)
    hf = MistralForCausalLM(cfg)
    mesh = init_tsp_mesh(world)
    layout = ZigzagLayout(seq, world)
    pos = layout.positions(rank)[None]
    x = torch.randn(1, seq, cfg.hidden_size)
    x = layout.shard(x, rank).requires_grad_()
    cos_sin = hf.model.rotary_emb(x, pos)
    out = {}
    for mode, exchange in (("window", True), ("all-gather", False)):
        tsp = TSPConfig(window_exchange=exchange)
        model = apply_tsp(MistralForCausalLM(config()), mesh, config=tsp)
        attn = model.model.layers[0].self_attn
        dy = torch.randn_like(x)
        times = []
        for _ in range(steps + 1):
            fwd, bwd = CommCounter(), CommCounter()
            t0 = time.perf_counter()
            with fwd:
                y, _ = attn(x, cos_sin)
            with bwd:
                y.backward(dy)
            times.append(time.perf_counter() - t0)
            attn.zero_grad()
            x.grad = None
        ex = WindowExchange.for_layout(layout, window if exchange else None)
        held = seq if ex is None else sum(e - b for b, e in ex.bounds[rank])
        out[mode] = dict(
            step_s=statistics.median(times[1:]),
            kv_fwd=_kv_bytes(fwd),
            kv_bwd=_kv_bytes(bwd),
            kv_tokens_held=held,
        )
    return out


def bench(window: int, seq: int, sizes, steps: int) -> list[dict]:
    from tsp_ext.testing.launch import run_processes

    rows = []
    for D in sizes:
        per_rank = run_processes(_worker, D, window, seq, steps, timeout=900)
        base = max(r["all-gather"]["step_s"] for r in per_rank)
        for mode in ("window", "all-gather"):
            step = max(r[mode]["step_s"] for r in per_rank)
            rows.append(
                {
                    "D": D,
                    "window": window,
                    "seq_len": seq,
                    "mode": mode,
                    "kv_bytes_fwd": max(r[mode]["kv_fwd"] for r in per_rank),
                    "kv_bytes_bwd": max(r[mode]["kv_bwd"] for r in per_rank),
                    "kv_tokens_held": max(r[mode]["kv_tokens_held"] for r in per_rank),
                    "step_s": step,
                    "step_vs_all_gather": step / base,
                }
            )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| D | mode | K/V MiB received fwd | bwd | K/V tokens held | step s | vs all-gather |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['D']} | {r['mode']} | {r['kv_bytes_fwd'] / 2**20:.2f} | "
            f"{r['kv_bytes_bwd'] / 2**20:.2f} | {r['kv_tokens_held']} | {r['step_s']:.3f} | "
            f"{r['step_vs_all_gather']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512, help="sliding window W")
    parser.add_argument("--seq-len", type=int, default=None, help="S (default 8W)")
    parser.add_argument("--tsp", type=int, nargs="+", default=[2, 4], help="TSP sizes D")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    rows = bench(args.window, args.seq_len or 8 * args.window, args.tsp, args.steps)
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
