"""A tiny-width Qwen2.5-VL with a long video under TSP, against one process and the sequence-
parallel baselines that exist for Hugging Face models.

    python -m benchmarks.vision                       # 48 frames of 16x16 patches, D = 2 and 4
    python -m benchmarks.vision --json docs/benchmarks/vision_cpu.json
    python -m benchmarks.vision --frames 8 --patches 8 --text 64 --tsp 2 --steps 1

``Qwen2_5_VLForConditionalGeneration`` built from its config (``TEXT``: h 128, 2 layers, 4
query / 2 KV heads, vocab 1024; ``VISION``: h 64, depth 2, window 112 pixels, one full-attention
block; float32, SDPA), batch 1: ``--text`` text tokens around one video of ``--frames`` frames of
``--patches`` x ``--patches`` patches of 14 pixels (temporal patch 2: ``frames / 2`` temporal
slices, ``frames · patches² / 8`` placeholder tokens after the 2x2 merge), labels -100 on the
video tokens. Forward + backward of the loss, in one run:

* ``1 process``: the unmodified Hugging Face model on the full batch;
* ``tsp`` at each D: ``apply_tsp`` on the same model, ``model(**shard_batch(batch, mesh,
  model=model))`` (each rank encodes its run of temporal slices, holds 1/D of the tokens);
* ``ulysses`` (DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers``, ALST's
  Hugging Face path: contiguous 1/D of ``input_ids`` / ``labels`` per rank, the pixels whole)
  and ``ring`` (torch's ``context_parallel`` on the token buffers, the model's own forward;
  Accelerate's ``maybe_context_parallel``, hence the Trainer's context parallelism, wraps this
  same call) at the smallest D: a row that raises records ``type: message`` and the model
  function that raised it instead of numbers.

Per row (max over ranks): the bytes autograd saves (``SavedTensorBytes``, parameters excluded)
and the vision tower's part of them, the peak resident-set growth during a step (measured as
``benchmarks.harness`` does, after the timing), the step time (median of ``--steps`` after one
warm-up) and its ratio to the single process's, and the loss, asserted equal to the single
process's to float32 tolerance. On a machine with fewer cores than D the ranks share cores:
step times then include that contention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from benchmarks.baseline_rows import failure, merged_row
from benchmarks.harness import memory_now, mmap_large_allocations, peak_memory, reset_peak
from tsp_ext import apply_tsp, init_tsp_mesh, shard_batch
from tsp_ext.memory import SavedTensorBytes

VIDEO, START, END = 1001, 1002, 1003
TEXT = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 6, 6]),
)
VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    out_hidden_size=128,
    window_size=112,
    fullatt_block_indexes=[1],
)
BASELINES = ("ulysses", "ring")
CPU = torch.device("cpu")


def build_model() -> Qwen2_5_VLForConditionalGeneration:
    """The same randomly initialised float32 model on every rank."""
    cfg = Qwen2_5_VLConfig(
        text_config=dict(TEXT, vocab_size=TEXT["vocab_size"] + 4, bos_token_id=1, eos_token_id=2),
        vision_config=VISION,
        image_token_id=1000,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def video_batch(frames: int, patches: int, text: int) -> dict[str, torch.Tensor]:
    """One row: half the text, ``<vision_start>``, the video's placeholders, ``<vision_end>``,
    the rest of the text; labels are the ids, -100 on the video's placeholders."""
    if frames % 2 or patches % 2:
        raise ValueError(f"--frames ({frames}) and --patches ({patches}) must be even")
    t = frames // 2
    g = torch.Generator().manual_seed(1)
    words = torch.randint(3, 1000, (text,), generator=g)
    n = t * patches * patches // 4
    video = torch.tensor([START, *[VIDEO] * n, END])
    ids = torch.cat([words[: text // 2], video, words[text // 2 :]])[None]
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.masked_fill(ids == VIDEO, -100),
        "mm_token_type_ids": 2 * (ids == VIDEO).int(),
        "pixel_values_videos": torch.randn(t * patches * patches, 3 * 2 * 14 * 14, generator=g),
        "video_grid_thw": torch.tensor([[t, patches, patches]]),
    }


def _time(model, inputs: dict, steps: int) -> tuple[float, float]:
    """Median forward + backward seconds over ``steps`` after one warm-up, and the loss."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad()
    return statistics.median(times[1:]), loss.item()


def _instrumented(model, inputs: dict) -> dict:
    """One step's saved bytes (all, and the vision tower's: its own hooks, innermost while it
    runs) and its peak resident-set growth over the step's start."""
    visual = model.model.visual
    params = list(model.parameters())
    tower = SavedTensorBytes(params)
    hooks = [
        visual.register_forward_pre_hook(lambda *_: tower.__enter__() and None),
        visual.register_forward_hook(lambda *_: tower.__exit__(None, None, None)),
    ]
    base = memory_now(CPU)
    reset_peak(CPU)
    with SavedTensorBytes(params) as rest:
        loss = model(**inputs).loss
    loss.backward()
    peak = peak_memory(CPU) - base
    for h in hooks:
        h.remove()
    model.zero_grad()
    return {"saved": rest.nbytes + tower.nbytes, "vision_saved": tower.nbytes, "peak_delta": peak}


def _measure(model, inputs: dict, steps: int) -> dict:
    step, loss = _time(model, inputs, steps)
    mmap_large_allocations()
    return {"step_s": step, "loss": loss, **_instrumented(model, inputs)}


def _worker(rank, world, sizes, steps, single):
    """The single process on rank 0 (while the other ranks wait), then TSP on every rank."""
    torch.set_num_threads(1)
    batch = video_batch(*sizes)
    out = {}
    if single and rank == 0:
        out["1 process"] = _measure(build_model(), batch, steps)
    model = apply_tsp(build_model(), init_tsp_mesh(world))
    out["tsp"] = _measure(model, shard_batch(batch, init_tsp_mesh(world), model=model), steps)
    return out


def _ulysses_inputs(model, batch: dict, world: int, rank: int) -> dict:
    """DeepSpeed's Ulysses on the model (installed in place of SDPA, for the whole process) and
    this rank's contiguous 1/D of the tokens and of their positions ``0..S-1``, as ALST's
    data-loader adapter cuts them."""
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.comm.init_distributed(dist_backend="gloo")
    S = batch["input_ids"].shape[1]
    UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", world, 1, seq_length=S, seq_length_is_variable=False
    )
    tokens = ("input_ids", "labels", "mm_token_type_ids")
    full = {k: batch[k] for k in tokens} | {"position_ids": torch.arange(S)[None]}
    local = {k: v.chunk(world, dim=1)[rank] for k, v in full.items()}
    return {**local, **{k: batch[k] for k in ("pixel_values_videos", "video_grid_thw")}}


def _baseline_worker(rank, world, name, sizes, steps):
    """A baseline's row on this rank, or the error it raises (``type: message``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.set_num_threads(1)
    batch = video_batch(*sizes)
    model = build_model()
    try:
        if name == "ulysses":
            return _measure(model, _ulysses_inputs(model, batch, world, rank), steps)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        tokens = [batch[k].clone() for k in ("input_ids", "labels", "mm_token_type_ids")]
        with context_parallel(mesh, buffers=tokens, buffer_seq_dims=[1, 1, 1]):
            inputs = dict(zip(("input_ids", "labels", "mm_token_type_ids"), tokens))
            inputs.update({k: batch[k] for k in ("pixel_values_videos", "video_grid_thw")})
            return _measure(model, inputs, steps)
    except Exception as e:  # the row reports it, where the model raised it
        return failure(e)


def bench(
    sizes: tuple[int, int, int],
    tsp,
    steps: int,
    baselines=BASELINES,
    timeout: float = 900,
    launch=None,
) -> list[dict]:
    """Rows: one process, TSP at each D in ``tsp``, then each baseline at the smallest D.
    ``launch`` (default ``run_processes``) runs TSP and the ring; Ulysses, which replaces SDPA
    in the whole process, always gets processes of its own."""
    from tsp_ext.testing.launch import run_processes

    launch = launch or run_processes
    rows, single = [], None
    for D in tsp:  # the first size's rank 0 also runs the single process
        per_rank = launch(_worker, D, sizes, steps, single is None, timeout=timeout)
        if single is None:
            single = per_rank[0]["1 process"]
            rows.append({**merged_row("1 process", 1, per_rank[:1], None), "vs_1_process": 1.0})
        rows.append(merged_row("tsp", D, per_rank, single))
    D = min(tsp)
    for name in baselines:
        run = run_processes if name == "ulysses" else launch
        try:
            per_rank = run(_baseline_worker, D, name, sizes, steps, timeout=timeout)
            rows.append(merged_row(name, D, [{name: r} for r in per_rank], single))
        except RuntimeError as e:  # a rank died or the run hung
            rows.append({"D": D, "path": name, "ok": False, "error": str(e).splitlines()[0]})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| D | path | saved MiB | vision saved MiB | peak growth MiB | step s | vs 1 process "
        "| loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            where = f" (in {', '.join(r['where'])})" if r.get("where") else ""
            lines.append(f"| {r['D']} | {r['path']} | does not run{where}: `{r['error']}` |||||||")
            continue
        lines.append(
            f"| {r['D']} | {r['path']} | {r['saved'] / 2**20:.1f} | "
            f"{r['vision_saved'] / 2**20:.1f} | {r['peak_delta'] / 2**20:.1f} | "
            f"{r['step_s']:.3f} | {r['vs_1_process']:.2f} | {r['loss']:.6f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=48, help="video frames (even)")
    parser.add_argument("--patches", type=int, default=16, help="patches per frame side (even)")
    parser.add_argument("--text", type=int, default=512, help="text tokens")
    parser.add_argument("--tsp", type=int, nargs="+", default=[2, 4], help="TSP sizes D")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    sizes = (args.frames, args.patches, args.text)
    rows = bench(sizes, args.tsp, args.steps)
    print(markdown_table(rows))
    if args.json:
        S = video_batch(*sizes)["input_ids"].shape[1]
        out = {"text": TEXT, "vision": VISION, "frames": args.frames, "patches": args.patches}
        with open(args.json, "w") as f:
            json.dump({**out, "text_tokens": args.text, "seq_len": S, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
