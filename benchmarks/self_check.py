"""What ``apply_tsp``'s self-check costs per model type: seconds and the size of the miniature it
folds, at D = 2 and 4, for the default config of each model type TSP folds (the pinned
transformers' defaults: the released checkpoints' head and expert counts).

    python -m benchmarks.self_check                   # D = 2 and 4, best of 3
    python -m benchmarks.self_check --json docs/benchmarks/self_check_cpu.json

Each timing is one ``self_check`` call with no config proven yet in the process (the model on the
meta device, as ``load_pretrained`` has it before any weight is read): building the float64
miniature twice (a meta skeleton to find the layer kinds, then the real one), folding a copy,
the reference's run, its float32 run and the folded run, forward and backward, the gradients
gathered. A second ``apply_tsp`` of the same config in the process costs nothing.
"""

from __future__ import annotations

import argparse
import json
import time

from tsp_ext.testing.launch import run_processes

TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3_text",
    "phi3",
    "olmo2",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_text",
)


def worker(rank: int, world: int, types: tuple[str, ...], repeats: int) -> list[dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tsp_ext import TSPConfig, init_tsp_mesh
    from tsp_ext.hf import self_check as check
    from tsp_ext.hf.miniature import build_miniature, decoder_layers

    mesh = init_tsp_mesh(world)
    group = mesh["tsp"].get_group()
    rows = []
    for model_type in types:
        config = AutoConfig.for_model(model_type)
        cls = AutoModelForCausalLM._model_mapping[type(config)]
        with torch.device("meta"):
            model = cls._from_config(config)
        seconds = []
        for _ in range(repeats):
            check._proven.clear()
            t0 = time.perf_counter()
            check.self_check(model, mesh, group, TSPConfig())
            seconds.append(time.perf_counter() - t0)
        mini = build_miniature(cls, config, tsp_size=world)  # what the check folds
        rows.append(
            {
                "model_type": model_type,
                "D": world,
                "seconds": min(seconds),
                "miniature_parameters": sum(p.numel() for p in mini.parameters()),
                "miniature_layers": len(decoder_layers(mini)),
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    """One line per model type: the miniature's layers and parameters (at the first D: its
    experts follow D), seconds per D."""
    sizes = sorted({r["D"] for r in rows})
    head = (
        f"| model type | miniature layers | miniature parameters (D = {sizes[0]}) | "
        + " | ".join(f"D = {d} (s)" for d in sizes)
    )
    lines = [head + " |", "|---|---|---|" + "---|" * len(sizes)]
    for t in dict.fromkeys(r["model_type"] for r in rows):
        mine = {r["D"]: r for r in rows if r["model_type"] == t}
        first = mine[sizes[0]]
        cells = [f"`{t}`", str(first["miniature_layers"]), f"{first['miniature_parameters']:,}"]
        cells += [f"{mine[d]['seconds']:.2f}" for d in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tsp", type=int, nargs="+", default=[2, 4], help="TSP sizes to run")
    p.add_argument("--types", nargs="+", default=list(TYPES), help="model types to time")
    p.add_argument("--repeats", type=int, default=3, help="timings per type (the best is kept)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for D in args.tsp:
        rows += run_processes(worker, D, tuple(args.types), args.repeats, timeout=1800)[0]
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
