"""Inference benchmark: TSP prefill and decode vs one process and vs DTensor tensor parallelism
at the same D (CPU, gloo; not a timed test).

    python -m benchmarks.decode                 # D = 2, prints a table
    python -m benchmarks.decode --json          # the rows as JSON

Each rank runs one thread (``run_processes`` sets it), so D ranks use D cores and the
single-process baseline (Hugging Face ``generate`` with its ``DynamicCache``, no TSP) one core.
The TP baseline is the same Hugging Face model under PyTorch ``parallelize_module`` with the
model's own tp plan (``benchmarks.layouts``), generating with its ``DynamicCache`` of local heads.
Rows, max over ranks:

- ``prefill``: one forward over a ``--prompt``-token prompt filling the cache: seconds, then (in a
  second, untimed run) the peak of tensor bytes allocated during it (``PeakAllocated``);
- ``decode Bx``: greedy ``generate`` of ``--new`` tokens after a ``--decode-prompt``-token prompt,
  batch B: decode tokens/s (all sequences, after the first token) and KV-cache bytes per rank.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor

from tsp_ext import TSPCache, apply_tsp, init_tsp_mesh
from tsp_ext.memory import PeakAllocated
from tsp_ext.testing.launch import run_processes

from .layouts import hf_tp_plan

# a small Llama (GQA) that D = 2 and 4 divide
MODEL = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
)


class _StepClock(LogitsProcessor):
    """Records when each step's logits arrive (the first right after the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _model(max_len: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**MODEL, max_position_embeddings=max_len, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.update(eos_token_id=None, pad_token_id=0)
    return model


@torch.no_grad()
def _prefill(model, ids: torch.Tensor, tsp: bool) -> None:
    """One forward over the prompt that fills a new KV cache."""
    if tsp:
        model(input_ids=ids, cache=TSPCache(model))
    else:
        model(input_ids=ids, use_cache=True)


def _worker(rank: int, world: int, layout: str, args) -> dict:
    model = _model(args.prompt + args.new)
    tsp = layout == "tsp"
    if tsp:
        apply_tsp(model, init_tsp_mesh(world))
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, hf_tp_plan(model))
    ids = torch.randint(0, MODEL["vocab_size"], (1, args.prompt), generator=torch.Generator())
    _prefill(model, ids[:, :64], tsp)  # warm-up
    start = time.perf_counter()
    _prefill(model, ids, tsp)
    prefill_s = time.perf_counter() - start
    with PeakAllocated() as peak:  # a second, untimed prefill under the profiler
        _prefill(model, ids, tsp)
    row = {"prefill_s": prefill_s, "prefill_peak_bytes": peak.nbytes}
    for B in args.batches:
        ids = torch.randint(0, MODEL["vocab_size"], (B, args.decode_prompt))
        clock = _StepClock()
        out = model.generate(
            ids,
            max_new_tokens=args.new,
            do_sample=False,
            logits_processor=[clock],
            return_dict_in_generate=True,
        )
        end = time.perf_counter()
        layers = out.cache.layers
        row[f"decode_b{B}_tokens_per_s"] = B * (args.new - 1) / (end - clock.times[0])
        row[f"kv_b{B}_bytes"] = sum(
            _local(layer.keys).nbytes + _local(layer.values).nbytes for layer in layers
        )
    row["weight_bytes"] = sum(_local(p).nbytes for p in model.parameters())
    return row


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def measure(args) -> dict[str, dict]:
    """``{"1 process": row, "TP D=n": row, "TSP D=n": row}``, each row the max over its ranks."""
    rows = {}
    for name, world, layout in (
        ("1 process", 1, "single"),
        (f"TP D={args.tsp_size}", args.tsp_size, "tp"),
        (f"TSP D={args.tsp_size}", args.tsp_size, "tsp"),
    ):
        per_rank = run_processes(_worker, world, layout, args, timeout=900)
        rows[name] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tsp-size", type=int, default=2)
    p.add_argument("--prompt", type=int, default=4096, help="prefill prompt tokens")
    p.add_argument("--decode-prompt", type=int, default=1024, help="prompt tokens before decode")
    p.add_argument("--new", type=int, default=32, help="new tokens per decode run")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = measure(args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    keys = list(next(iter(rows.values())))
    print("| metric | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        cells = [f"{r[k]:,.3f}" if isinstance(r[k], float) else f"{r[k]:,}" for r in rows.values()]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
