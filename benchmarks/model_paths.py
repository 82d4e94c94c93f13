"""One model on one long sequence along every path, in one run: the unmodified Hugging Face model in
one process, TSP at each D, and the other sequence-parallel paths that exist for Hugging Face
models (``benchmarks.gpt_oss``, ``benchmarks.qwen3_next``).

A benchmark names a ``build`` function (a module-level function: it is sent to the spawned ranks)
returning the same randomly initialised float32 model on every rank. Batch 1, one random sequence
of ``seq`` tokens, forward + backward of the loss:

* ``1 process``: the model on the full sequence;
* ``tsp`` at each D: ``apply_tsp`` on the same model, ``model(**shard_batch(batch, mesh,
  model=model))`` (each rank holds 1/D of the tokens);
* at the smallest D, each baseline on the model's own forward, with this rank's share of
  ``input_ids``, of the positions ``0..S-1`` and of the labels shifted once over the whole
  sequence (the loss: their cross-entropy summed, over ``S - 1``, all-reduced): ``ulysses``
  (DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` with the model's attention,
  ALST's Hugging Face path, contiguous 1/D per rank), ``ring`` (torch's ``context_parallel`` on
  the token buffers; Accelerate's ``maybe_context_parallel``, hence the Trainer's context
  parallelism, wraps this same call), and ``ulysses-sdpa`` / ``ring-sdpa``, the same with the
  model switched to SDPA after construction. A row that raises records ``type: message`` and the
  model's (else the library's) function that raised it instead of numbers; a row that runs but
  whose loss differs from the single process's is marked wrong (``loss_ok: false``).

Per row (max over ranks): the bytes autograd saves (``SavedTensorBytes``, parameters excluded),
the peak resident-set growth during a step (measured as ``benchmarks.harness`` does, after the
timing), the step time (median of ``steps`` after one warm-up) and its ratio to the single
process's, and the loss, equal to the single process's when within 1e-5 of it (relative: float32
tolerance; TSP's is asserted, a baseline's past it is marked wrong). On a machine with fewer
cores than D the ranks share cores: step times then include that contention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.baseline_rows import failure, merged_row
from benchmarks.harness import memory_now, mmap_large_allocations, peak_memory, reset_peak
from tsp_ext import apply_tsp, init_tsp_mesh, shard_batch
from tsp_ext.memory import SavedTensorBytes

CPU = torch.device("cpu")


def token_batch(seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """One random row of ``seq`` tokens below ``vocab``; the labels are the ids."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _time(step, model, steps: int) -> tuple[float, float]:
    """Median forward + backward seconds over ``steps`` after one warm-up, and the loss."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss, total = step()
        loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad()
    return statistics.median(times[1:]), total


def _instrumented(step, model) -> dict:
    """One step's saved bytes and its peak resident-set growth over the step's start."""
    base = memory_now(CPU)
    reset_peak(CPU)
    with SavedTensorBytes(list(model.parameters())) as saved:
        loss, _ = step()
    loss.backward()
    peak = peak_memory(CPU) - base
    model.zero_grad()
    return {"saved": saved.nbytes, "peak_delta": peak}


def _measure(model, step, steps: int) -> dict:
    """``step()`` returns (this rank's loss to differentiate, the whole sequence's loss)."""
    seconds, loss = _time(step, model, steps)
    mmap_large_allocations()
    return {"step_s": seconds, "loss": loss, **_instrumented(step, model)}


def _model_loss(model, inputs: dict):
    def step():
        loss = model(**inputs).loss
        return loss, loss.item()

    return step


def _worker(rank, world, build, seq, steps, single):
    """The single process on rank 0 (while the other ranks wait), then TSP on every rank."""
    torch.set_num_threads(1)
    model = build()
    batch = token_batch(seq, model.config.vocab_size)
    out = {}
    if single and rank == 0:
        out["1 process"] = _measure(model, _model_loss(model, batch), steps)
        model = build()
    model = apply_tsp(model, init_tsp_mesh(world))
    inputs = shard_batch(batch, init_tsp_mesh(world), model=model)
    out["tsp"] = _measure(model, _model_loss(model, inputs), steps)
    return out


def _sharded_loss(model, local: dict[str, torch.Tensor], count: int):
    """The model's logits on this rank's tokens; their summed cross-entropy over ``count``,
    and that all-reduced (the whole sequence's loss)."""

    def step():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = F.cross_entropy(logits[0], local["labels"][0], reduction="sum") / count
        total = loss.detach().clone()
        dist.all_reduce(total)
        return loss, total.item()

    return step


def _baseline(model, name: str, tokens: dict[str, torch.Tensor], world: int, rank: int, steps):
    """``name``'s row on this rank: Ulysses on contiguous 1/D, the ring on the buffers it shards."""
    count = tokens["input_ids"].shape[1] - 1
    if name.startswith("ulysses"):
        import deepspeed.comm
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.comm.init_distributed(dist_backend="gloo")
        S = tokens["input_ids"].shape[1]
        UlyssesSPAttentionHF.register_with_transformers(
            model,
            model.config._attn_implementation,
            world,
            1,
            seq_length=S,
            seq_length_is_variable=False,
        )
        local = {k: v.chunk(world, dim=1)[rank] for k, v in tokens.items()}
        return _measure(model, _sharded_loss(model, local, count), steps)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    local = {k: v.clone() for k, v in tokens.items()}  # sharded in place
    with context_parallel(mesh, buffers=list(local.values()), buffer_seq_dims=[1, 1, 1]):
        return _measure(model, _sharded_loss(model, local, count), steps)


def _baseline_worker(rank, world, build, name, seq, steps):
    """A baseline's row on this rank, or the error it raises (``type: message``)."""
    torch.set_num_threads(1)
    try:
        model = build()
        ids = token_batch(seq, model.config.vocab_size)["input_ids"]
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        tokens = {"input_ids": ids, "position_ids": torch.arange(seq)[None], "labels": labels}
        if name.endswith("-sdpa"):  # past a model's refusal to be built on SDPA (gpt-oss)
            model.config._attn_implementation = "sdpa"
        return _baseline(model, name, tokens, world, rank, steps)
    except Exception as e:  # the row reports it, where the model raised it
        return failure(e)


def bench(
    build: Callable, seq: int, tsp, steps: int, baselines, timeout: float = 900, launch=None
) -> list[dict]:
    """Rows of ``build()``'s model: one process, TSP at each D in ``tsp``, then each baseline at
    the smallest D.
    ``launch`` (default ``run_processes``) runs TSP and the ring; Ulysses, which replaces the
    attention in the whole process, always gets processes of its own."""
    from tsp_ext.testing.launch import run_processes

    launch = launch or run_processes
    rows, single = [], None
    for D in tsp:  # the first size's rank 0 also runs the single process
        per_rank = launch(_worker, D, build, seq, steps, single is None, timeout=timeout)
        if single is None:
            single = per_rank[0]["1 process"]
            rows.append({**merged_row("1 process", 1, per_rank[:1], None), "vs_1_process": 1.0})
            rows[-1]["loss_ok"] = True
        rows.append(merged_row("tsp", D, per_rank, single))
    D = min(tsp)
    for name in baselines:
        run = run_processes if name.startswith("ulysses") else launch
        try:
            per_rank = run(_baseline_worker, D, build, name, seq, steps, timeout=timeout)
            rows.append(merged_row(name, D, [{name: r} for r in per_rank], single))
        except RuntimeError as e:  # a rank died or the run hung
            rows.append({"D": D, "path": name, "ok": False, "error": str(e).splitlines()[0]})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| D | path | saved MiB | peak growth MiB | step s | vs 1 process | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            where = f" (in {', '.join(r['where'])})" if r.get("where") else ""
            lines.append(f"| {r['D']} | {r['path']} | does not run{where}: `{r['error']}` |||||")
            continue
        wrong = "" if r["loss_ok"] else " (wrong)"
        lines.append(
            f"| {r['D']} | {r['path']} | {r['saved'] / 2**20:.1f} | "
            f"{r['peak_delta'] / 2**20:.1f} | {r['step_s']:.3f} | {r['vs_1_process']:.2f} | "
            f"{r['loss']:.6f}{wrong} |"
        )
    return "\n".join(lines)


def main(description: str, build: Callable, config: dict, baselines, argv=None) -> None:
    """The command line of a benchmark of ``build()``'s model (``config``: what the JSON records
    of it): ``--seq``, ``--tsp``, ``--steps``, ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seq", type=int, default=4096, help="tokens in the sequence")
    parser.add_argument("--tsp", type=int, nargs="+", default=[2, 4], help="TSP sizes D")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    rows = bench(build, args.seq, args.tsp, args.steps, baselines)
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "seq_len": args.seq, "rows": rows}, f, indent=2)
            f.write("\n")
