"""A mixture-of-experts layer under TSP: both schedules against one process, and their crossover.

    python -m benchmarks.moe                               # the table: D = 2 and 4
    python -m benchmarks.moe --json docs/benchmarks/moe_cpu.json
    python -m benchmarks.moe --crossover --tokens 512 1024 2048 4096 8192

One Qwen3-MoE sparse block (``--model``: h 256, E = 64 experts of F = 128, top-2, float32; its
router and experts), forward + backward of S tokens (batch 1), in one run:

* ``1 process``: Hugging Face's block on all S tokens (its per-expert loop);
* ``ring`` / ``all_to_all`` at each D: ``TSPSparseMoe`` on this rank's S/D tokens with
  ``TSPConfig(moe_schedule=...)`` (each rank owns E/D whole experts).

Per row (max over ranks): the expert bytes a rank holds, the bytes autograd saves
(``SavedTensorBytes``, parameters excluded), the peak resident-set growth during a step (CPU,
measured as ``benchmarks.harness`` does, after the timing), the bytes a rank receives in forward
and backward (``CommCounter``), the step time (median of ``--steps`` after one warm-up) and its
ratio to the single process's. ``--crossover`` times ring and all-to-all at D = ``--tsp`` for
several token counts per rank and prints where all-to-all starts to win, measured (linear
interpolation of the time ratio) and as ``engine.feed_forward.moe_traffic.schedule_for`` predicts
from the elements each moves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from benchmarks.comm_counter import CommCounter
from benchmarks.harness import memory_now, mmap_large_allocations, peak_memory, reset_peak
from tsp_ext import TSPConfig
from tsp_ext.engine.feed_forward.moe_traffic import traffic
from tsp_ext.engine.sharding.layout import ZigzagLayout
from tsp_ext.hf.families import QWEN_MOE
from tsp_ext.hf.moe import TSPSparseMoe
from tsp_ext.memory import SavedTensorBytes

MODEL = dict(hidden_size=256, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=128)
SCHEDULES = ("ring", "all_to_all")


def hf_block(model: dict) -> Qwen3MoeSparseMoeBlock:
    """The Hugging Face block with random weights (router included), the same on every rank."""
    cfg = Qwen3MoeConfig(**model)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    return block


def _time(module, x: torch.Tensor, dy: torch.Tensor, steps: int) -> float:
    """Median forward + backward seconds of ``module(x)`` over ``steps`` after one warm-up."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        module(x).backward(dy)
        times.append(time.perf_counter() - t0)
        module.zero_grad()
        x.grad = None
    return statistics.median(times[1:])


def _instrumented(module, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """One step's saved bytes, bytes received in forward and backward, and peak resident-set
    growth over the step's start (CPU), plus the expert bytes the module holds."""
    fwd, bwd = CommCounter(), CommCounter()
    base = memory_now(x.device)
    reset_peak(x.device)
    with fwd, SavedTensorBytes(module.parameters()) as saved:
        y = module(x)
    with bwd:
        y.backward(dy)
    peak = peak_memory(x.device) - base
    module.zero_grad()
    x.grad = None
    return {
        "experts": sum(p.nbytes for n, p in module.named_parameters() if "experts" in n),
        "saved": saved.nbytes,
        "recv_fwd": sum(fwd.received.values()),
        "recv_bwd": sum(bwd.received.values()),
        "peak_delta": peak,
    }


def _worker(rank, world, model, tokens, schedules, steps, single):
    """Time every module first, then instrument each (the peak-RSS allocator setting would
    slow the timing: ``benchmarks.harness``)."""
    torch.set_num_threads(1)
    hf = hf_block(model)
    S = tokens * world
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, S, model["hidden_size"], generator=g)
    runs = {}
    if single and rank == 0:  # all S tokens in one process, while the other ranks wait
        runs["1 process"] = (hf, x.clone().requires_grad_())
    xl = ZigzagLayout(S, world).shard(x, rank).requires_grad_()
    for schedule in schedules:
        config = TSPConfig(moe_schedule=schedule)
        runs[schedule] = (TSPSparseMoe.from_hf(hf, dist.group.WORLD, config, QWEN_MOE), xl)
    dys = {name: torch.randn(x.shape, generator=g) for name, (_, x) in runs.items()}
    out = {name: {"step_s": _time(m, x, dys[name], steps)} for name, (m, x) in runs.items()}
    mmap_large_allocations()
    for name, (m, x) in runs.items():
        out[name].update(_instrumented(m, x, dys[name]))
    return out


def _merge(per_rank: list[dict], name: str) -> dict:
    rows = [r[name] for r in per_rank if name in r]
    return {k: max(r[k] for r in rows) for k in rows[0]}


def bench(model: dict, seq: int, sizes, steps: int) -> list[dict]:
    """Rows of the table: one process, then ring and all-to-all at each D in ``sizes``."""
    from tsp_ext.testing.launch import run_processes

    rows, single = [], None
    for D in sizes:  # the first size's rank 0 also times the single process
        per_rank = run_processes(_worker, D, model, seq // D, SCHEDULES, steps, single is None)
        if single is None:
            single = _merge(per_rank, "1 process")
            rows.append({"D": 1, "schedule": "1 process", "seq_len": seq, **single})
            rows[0]["vs_1_process"] = 1.0
        for schedule in SCHEDULES:
            row = _merge(per_rank, schedule)
            ratio = row["step_s"] / single["step_s"]
            rows.append(
                {"D": D, "schedule": schedule, "seq_len": seq, **row, "vs_1_process": ratio}
            )
    return rows


def crossover(model: dict, D: int, tokens, steps: int) -> dict:
    """Ring and all-to-all step times at ``D`` for each count of tokens per rank, the count
    where all-to-all starts to win (measured, interpolated; None if it never or always does)
    and the count where ``traffic`` says their elements are equal."""
    from tsp_ext.testing.launch import run_processes

    points = []
    for n in tokens:
        per_rank = run_processes(_worker, D, model, n, SCHEDULES, steps, False)
        ring, a2a = (_merge(per_rank, s)["step_s"] for s in SCHEDULES)
        points.append({"tokens_per_rank": n, "ring_s": ring, "all_to_all_s": a2a})
    measured = None
    for a, b in zip(points, points[1:]):
        ra, rb = (p["all_to_all_s"] / p["ring_s"] for p in (a, b))
        if ra <= 1 < rb:  # all-to-all wins below, the ring above
            t = (1 - ra) / (rb - ra)
            measured = a["tokens_per_rank"] + t * (b["tokens_per_rank"] - a["tokens_per_rank"])
    E, F, h, k = (
        model[key]
        for key in ("num_experts", "moe_intermediate_size", "hidden_size", "num_experts_per_tok")
    )
    ring = traffic(1, k, E, F, h, D)["ring"]
    per_token = traffic(1, k, E, F, h, D)["all_to_all"]
    return {"D": D, "points": points, "measured": measured, "planned": ring / per_token}


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| D | schedule | experts MiB | saved MiB | peak growth MiB | received MiB fwd | bwd "
        "| step s | vs 1 process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['D']} | {r['schedule']} | {r['experts'] / 2**20:.2f} | "
            f"{r['saved'] / 2**20:.2f} | {r['peak_delta'] / 2**20:.1f} | "
            f"{r['recv_fwd'] / 2**20:.2f} | "
            f"{r['recv_bwd'] / 2**20:.2f} | {r['step_s']:.3f} | {r['vs_1_process']:.2f} |"
        )
    return "\n".join(lines)


def crossover_table(result: dict) -> str:
    lines = [
        "| tokens per rank | ring s | all-to-all s | all-to-all / ring |",
        "|---|---|---|---|",
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['tokens_per_rank']} | {p['ring_s']:.3f} | {p['all_to_all_s']:.3f} | "
            f"{p['all_to_all_s'] / p['ring_s']:.2f} |"
        )
    measured = result["measured"]
    lines.append("")
    lines.append(
        f"D = {result['D']}: all-to-all wins below "
        f"{'-' if measured is None else f'{measured:.0f}'} tokens per rank (measured), "
        f"{result['planned']:.0f} (planned: equal elements moved)"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=json.loads, default={}, help="overrides of MODEL")
    parser.add_argument("--seq-len", type=int, default=8192, help="S of the table")
    parser.add_argument("--tsp", type=int, nargs="+", default=[2, 4], help="TSP sizes D")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--crossover", action="store_true", help="time the crossover instead")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    model = {**MODEL, **args.model}
    if args.crossover:
        results = [crossover(model, D, args.tokens, args.steps) for D in args.tsp]
        print("\n\n".join(crossover_table(r) for r in results))
        out = {"model": model, "crossover": results}
    else:
        rows = bench(model, args.seq_len, args.tsp, args.steps)
        print(markdown_table(rows))
        out = {"model": model, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
