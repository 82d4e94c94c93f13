"""Cost of an uneven TSP layout: training step time of models D does and does not divide (CPU).

    python -m benchmarks.uneven            # prints a table
    python -m benchmarks.uneven --json     # the rows as JSON

Each row times forward + backward of the fused loss (median of ``--steps`` after one warm-up,
max over ranks; one thread per rank) of a small two-layer Llama with head_dim 64 at a TSP size D:

- ``8/4 heads, D=2``: even (h = 512, F = 1408, V = 8192: 4 + 4 query heads, 2 KV heads each);
- ``9/3 heads, D=2``: uneven (h = 576: 5 + 4 query heads, KV head 1 on both ranks; F = 1473 and
  V = 8193 split 737 + 736 and 4097 + 4096);
- ``9/3 heads, D=3``: the same model on three ranks, where it is even (3 heads, 491 MLP rows and
  2731 vocabulary rows each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh, shard_batch
from tsp_ext.testing.launch import run_processes

BASE = dict(num_hidden_layers=2, max_position_embeddings=4096)
UNEVEN = dict(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1473,
    vocab_size=8193,
)
# name -> (config overrides, TSP size)
ROWS = {
    "8/4 heads, D=2": (dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4), 2),
    "9/3 heads, D=2": (
        dict(UNEVEN),
        2,
    ),
    "9/3 heads, D=3": (
        dict(UNEVEN),
        3,
    ),
}
EVEN = dict(intermediate_size=1408, vocab_size=8192)


def _worker(rank, world, overrides, seq, steps):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**BASE, **EVEN, **overrides}, attn_implementation="sdpa")
    model = apply_tsp(LlamaForCausalLM(cfg), init_tsp_mesh(world), config=TSPConfig())
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    batch = shard_batch({"input_ids": ids, "labels": ids}, model.tsp.mesh)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    return statistics.median(times[1:]), params


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1536, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    for name, (overrides, D) in ROWS.items():
        out = run_processes(_worker, D, overrides, args.seq, args.steps, timeout=900)
        rows.append(
            {
                "row": name,
                "step_s": max(t for t, _ in out),
                "params_per_rank": [n for _, n in out],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'row':<18} {'step s':>8}  params per rank")
    for r in rows:
        print(f"{r['row']:<18} {r['step_s']:>8.3f}  {r['params_per_rank']}")


if __name__ == "__main__":
    main()
