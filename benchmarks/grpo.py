"""GRPO under TSP against TRL's ``GRPOTrainer`` in one process and on DeepSpeed ZeRO-3.

    python -m benchmarks.grpo --devices 2 4 --budget-mib 384 --json docs/benchmarks/grpo_cpu.json
    python -m benchmarks.grpo --quick --devices 2      # a tiny model and lengths: the smoke test

Every layout runs TRL's ``GRPOTrainer`` code path with one ``GRPOConfig`` (TRL's defaults:
``loss_type="dapo"``, ``beta=0``, one iteration, gradient checkpointing; float32, AdamW) on the
same Llama-shaped model (``preference.MODEL``: h 256, 4 layers, V 8192) and the same global
batch of ``PROMPTS`` prompts of ``PROMPT_LEN`` tokens x ``G`` completions per step: ``trl`` is
``GRPOTrainer`` in one process (TRL's chunked fused LM head, full weights); ``zero3`` is
``GRPOTrainer`` with ``GRPOConfig(deepspeed=ZERO3)`` over D ranks, TRL's data parallelism (each
rank its own 1/D of the completions, whole: the most TRL offers, as it refuses sequence
parallelism); ``tsp`` is ``TSPGRPOTrainer`` at D ranks (tsp = D, dp = 1: every rank all
completions, 1/D of their tokens and of the weights).

(a) **Longest completion** (``--budget-mib``): the longest completion length L (a multiple of
``--granule`` up to ``--limit``, to within 1/16: ``maxlen.longest``, doubling from ``--start``,
then bisection) for which one GRPO step keeps every rank within the budget; "≥" when every
length up to ``--limit`` fits. The step is ``training_step``: rollouts (a ``rollout_func``
giving completions of exactly L tokens: generation, its KV cache included, is not in this
step), scoring, loss and backward, not the optimizer update; the second step is measured (the
first creates the optimizer state). A rank's bytes are its resident state, measured after the
step (parameters — ZeRO-3: its partitions —, optimizer state, ZeRO-3's fp32 master partitions
and persistent gradient partition), plus the step's peak of tensor bytes allocated above the
level at its entry (``PeakAllocated``, as ``benchmarks.preference`` measures its step peak:
the resident weights and optimizer state are not in it, so they are added once here; gathered
ZeRO-3 weights, gradients, activations and transients are). Max over ranks. Every probe of a
layout runs in the same processes, a fresh trainer each.

(b) **Rollouts and step time** (``--time-at L``): with generation on (the model's own
``generate()``, sampling, ``min_new_tokens = max_completion_length = L``; ZeRO-3 gathers the
weights for it, TRL's default), the generated tokens per second of a rollout round (the round's
new tokens over the slowest rank's time in ``_generate_single_turn``) and the time of a whole
step (rollouts to optimizer update, slowest rank), medians of ``--steps`` steps after a warm-up
step, as ratios to ``trl``'s, every layout timed in the same run, one after another. Prints a
markdown table; ``--json`` writes the rows (every probe), the settings and the machine's load
average at the start and the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tsp_ext.memory import PeakAllocated
from tsp_ext.testing.launch import run_processes

from .harness import local_bytes, optimizer_bytes
from .maxlen import longest
from .preference import MODEL, _tokenizer

MIB = 2**20
G, PROMPTS, PROMPT_LEN = 2, 2, 32  # completions per prompt, prompts per step, prompt tokens
LAYOUTS = ("trl", "zero3", "tsp")
# --quick: a tiny model, short lengths, one timed step (the smoke test's settings)
QUICK = dict(MODEL, hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=1024)
QUICK_SETTINGS = dict(budget=24 * MIB, start=32, granule=32, limit=128, time_at=8, steps=1)
NAMES = {
    "trl": "TRL GRPOTrainer, 1 process",
    "zero3": "TRL GRPOTrainer, ZeRO-3",
    "tsp": "TSPGRPOTrainer",
}
# DeepSpeed ZeRO-3 the Hugging Face way: "auto" values from the arguments and the model
ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def _prompts(vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (PROMPTS, PROMPT_LEN), generator=g)
    return Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in row) for row in ids.tolist()]})


def _fixed_length(length: int, prompts: list[str], trainer) -> dict:
    """TRL's ``rollout_func``: completions of exactly ``length`` random tokens (no EOS)."""
    tok, vocab = trainer.processing_class, trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(trainer.accelerator.process_index)
    completions = torch.randint(0, vocab - 1, (len(prompts), length), generator=g).tolist()
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def _reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(ids) % 7) for ids in completion_ids]


def _trainer(spec: dict, world: int, length: int, steps: int, generate: bool):
    """``spec["layout"]``'s trainer for ``steps`` steps with completions of ``length`` tokens:
    generated (sampling, at least ``length`` new tokens) or given by ``_fixed_length``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from tsp_ext import TSPConfig, TSPGRPOTrainer

    layout, model_cfg = spec["layout"], spec["model"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model_cfg, max_position_embeddings=PROMPT_LEN + length))
    rows = PROMPTS * G // (world if layout == "zero3" else 1)  # the same completions per step
    args = GRPOConfig(
        output_dir=spec["out"], per_device_train_batch_size=rows, num_generations=G,
        max_completion_length=length, max_steps=steps, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no", seed=0,
        deepspeed=ZERO3 if layout == "zero3" else None,
        generation_kwargs={"min_new_tokens": length} if generate else None,
    )  # fmt: skip
    kw = dict(reward_funcs=[_reward], args=args, train_dataset=_prompts(model_cfg["vocab_size"]))
    kw.update(processing_class=_tokenizer(model_cfg["vocab_size"]))
    if not generate:
        kw["rollout_func"] = functools.partial(_fixed_length, length)
    if layout == "tsp":
        return TSPGRPOTrainer(model, tsp=TSPConfig(tsp_size=world), **kw)
    return GRPOTrainer(model, **kw)


def _state_bytes(trainer) -> int:
    """This rank's resident state between steps: parameters (ZeRO-3: its partitions and its
    fp32 masters), optimizer state, and ZeRO-3's persistent gradient partition."""
    params = local_bytes(getattr(p, "ds_tensor", p) for p in trainer.model.parameters())
    engine = getattr(trainer, "deepspeed", None)
    if engine is None:
        return params + optimizer_bytes(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    zero = engine.optimizer
    flat = getattr(zero, "grad_partitions_flat_buffer", None)
    extra = local_bytes([*zero.fp32_partitioned_groups_flat, *([flat] if flat is not None else [])])
    return params + optimizer_bytes(zero.optimizer) + extra


def _probe(spec: dict, world: int, length: int) -> dict:
    """Two GRPO steps with completions of ``length`` tokens, the second measured: the most
    state and step peak over the ranks."""
    trainer = _trainer(spec, world, length, 2, generate=False)
    step, peaks = trainer.training_step, []

    def measured(*args, **kwargs):
        if trainer.state.global_step == 0:
            return step(*args, **kwargs)
        with PeakAllocated() as peak:
            loss = step(*args, **kwargs)
        peaks.append(peak.nbytes)
        return loss

    trainer.training_step = measured
    trainer.train()
    found = torch.tensor([_state_bytes(trainer), peaks[0]])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    state, peak = int(found[0]), int(found[1])
    return {"len": length, "state": state, "peak": peak, "bytes": state + peak}


def _timed(spec: dict, world: int) -> dict:
    """Rollout seconds and new tokens, and step seconds, per step after a warm-up step."""
    from transformers import TrainerCallback

    trainer = _trainer(spec, world, spec["time_at"], spec["steps"] + 1, generate=True)
    generate, rollouts, times = trainer._generate_single_turn, [], []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        rollouts.append((time.perf_counter() - t0, sum(len(c) for c in out[0])))
        return out

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    trainer._generate_single_turn = timed
    trainer.add_callback(Clock())
    trainer.train()
    return {"rollouts": rollouts[1:], "steps": times[1:]}


def _rank(rank: int, world: int, spec: dict) -> dict:
    """The longest completion under the budget (every rank probing the same lengths), then the
    timed steps."""
    probes = []

    def fits(length: int) -> bool:
        probes.append(_probe(spec, world, length))
        return probes[-1]["bytes"] <= spec["budget"]

    best = longest(fits, spec["start"], spec["granule"], spec["limit"])
    return {"max_len": best, "probes": probes, **(_timed(spec, world) if spec["time_at"] else {})}


def measure(layout: str, devices: int, settings: dict, launch: Callable = run_processes) -> dict:
    """One row: ``layout`` at ``devices`` ranks (``trl``: one process) under ``settings``
    (``run``'s: model, budget, start, granule, limit, time_at, steps, out)."""
    world = 1 if layout == "trl" else devices
    ranks = launch(_rank, world, {**settings, "layout": layout}, timeout=3600)
    found = ranks[0]
    at = next((p for p in found["probes"] if p["len"] == found["max_len"]), {})
    row = {
        "layout": layout,
        "devices": world,
        "max_len": found["max_len"],
        "capped": found["max_len"] == settings["limit"],
        "bytes_at_max": at.get("bytes"),
        "state_at_max": at.get("state"),
        "peak_at_max": at.get("peak"),
        "probes": found["probes"],
    }
    if settings["time_at"]:
        # new tokens of a round: every rank's own completions (a TSP group's ranks share theirs)
        sharing = world if layout == "tsp" else 1
        rates = []
        for per_rank in zip(*(r["rollouts"] for r in ranks), strict=True):
            tokens = sum(n for _, n in per_rank) // sharing
            rates.append(tokens / max(s for s, _ in per_rank))
        steps = [max(s) for s in zip(*(r["steps"] for r in ranks), strict=True)]
        row["tokens_per_s"] = statistics.median(rates)
        row["step_seconds"] = statistics.median(steps)
    return row


def run(
    devices: list[int], layouts: list[str], settings: dict, launch: Callable = run_processes
) -> dict:
    """Every layout's row at every D (``trl`` once), ratios to ``trl``'s, the load average."""
    load = [os.getloadavg()]
    rows = []
    for D in devices:
        for layout in layouts:
            if layout == "trl" and any(r["layout"] == "trl" for r in rows):
                continue  # one process: the same row at every D
            rows.append(measure(layout, D, settings, launch))
            print(f"{layout} D={rows[-1]['devices']}: longest {rows[-1]['max_len']}", flush=True)
    load.append(os.getloadavg())
    base = next((r for r in rows if r["layout"] == "trl"), {})
    for r in rows:
        for key in ("max_len", "tokens_per_s", "step_seconds"):
            if r.get(key) and base.get(key):
                r[f"{key}_ratio"] = r[key] / base[key]
    info = dict(G=G, prompts=PROMPTS, prompt_len=PROMPT_LEN, load_avg_1_5_15=load)
    return {**settings, **info, "rows": rows}


def markdown(result: dict) -> str:
    """The table: per layout and D the longest completion (≥: every probed length fit, up to
    ``--limit``), its bytes per rank, rollout throughput and step time at ``--time-at``."""

    def num(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "—"

    lines = [
        "| layout | D | longest completion | vs TRL | MiB per rank: state + step peak "
        f"| rollout tok/s (L = {result['time_at']}) | vs TRL | step s | vs TRL |",
        "|---" * 9 + "|",
    ]
    for r in result["rows"]:
        mem = "—"
        if r["bytes_at_max"] is not None:
            mem = f"{r['bytes_at_max'] / MIB:.1f} = {r['state_at_max'] / MIB:.1f} + "
            mem += f"{r['peak_at_max'] / MIB:.1f}"
        capped = "≥ " if r["capped"] else ""  # every probe fit, up to --limit
        longest, ratio = num(r, "max_len", "d"), num(r, "max_len_ratio", ".2f")
        lines.append(
            f"| {NAMES[r['layout']]} | {r['devices']} | {capped * (longest != '—')}{longest} "
            f"| {capped * (ratio != '—')}{ratio} | {mem} "
            f"| {num(r, 'tokens_per_s', '.0f')} | {num(r, 'tokens_per_s_ratio', '.2f')} "
            f"| {num(r, 'step_seconds', '.2f')} | {num(r, 'step_seconds_ratio', '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.grpo", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="D for zero3 and tsp")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--budget-mib", type=float, default=384, help="per-rank memory budget")
    ap.add_argument("--start", type=int, default=128, help="first completion length tried")
    ap.add_argument("--granule", type=int, default=64, help="lengths are multiples of this")
    ap.add_argument("--limit", type=int, default=2048, help="longest completion tried")
    ap.add_argument("--time-at", type=int, default=256, help="completion length timed (0: none)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after a warm-up step")
    ap.add_argument("--quick", action="store_true", help="a tiny model and lengths (smoke test)")
    ap.add_argument("--out", default="/tmp/tsp_grpo_bench", help="trainer output dir")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if args.budget_mib <= 0:
        raise SystemExit(f"--budget-mib {args.budget_mib}: give a positive budget")
    settings = dict(
        model=QUICK if args.quick else MODEL, budget=int(args.budget_mib * MIB),
        start=args.start, granule=args.granule, limit=args.limit, time_at=args.time_at,
        steps=args.steps, out=args.out,
    )  # fmt: skip
    if args.quick:
        settings.update(QUICK_SETTINGS)
    result = run(args.devices, args.layouts, settings)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
