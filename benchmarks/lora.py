"""LoRA against full fine-tuning under TSP: memory per rank and step time, one run.

    python -m benchmarks.lora --devices 2 4 --seq-len 4096 --rounds 3 \\
        --json docs/benchmarks/lora_cpu.json

Both layouts (``tsp`` and ``tsp_lora``: r = 16 on all seven projections, ``layouts.LORA``) train
the same model on the same batch, in turn, ``--rounds`` times over (medians), so a drift of the
machine touches both alike. Per device count the table gives each one's bytes per rank
(parameters, gradients, optimizer state, saved activations) and the LoRA step time as a ratio of
the full fine-tuning step's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .harness import measure
from .layouts import LORA
from .run import combine_rounds

LAYOUTS = ("tsp", "tsp_lora")
MEMORY = ("params", "grads", "optimizer", "activations")


def compare(devices: list[int], seq_len: int, model_cfg=None, rounds: int = 3, **kwargs) -> dict:
    """``{"lora": LORA, "rows": [...]}``: per device count one row with both layouts' results
    (``measure``'s rows, medians over the rounds) and the ratios LoRA / full."""
    rows = []
    for D in devices:
        runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
        for _ in range(rounds):
            for name in LAYOUTS:
                runs[name].append(measure(name, D, seq_len, model_cfg, **kwargs))
        full, lora = (combine_rounds(runs[name]) for name in LAYOUTS)
        row = {"devices": D, "seq_len": seq_len, "full": full, "lora": lora}
        if full["status"] == lora["status"] == "ok":
            row["step_ratio"] = lora["step_seconds"] / full["step_seconds"]
            row["activation_ratio"] = (
                lora["memory_bytes"]["activations"] / full["memory_bytes"]["activations"]
            )
        rows.append(row)
    return {"lora": LORA, "rows": rows}


def markdown(result: dict) -> str:
    mib = 2**20
    lines = [
        "| D | layout | params MiB | grads MiB | optimizer MiB | saved activations MiB "
        "| step s | LoRA / full step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name, key in (("full fine-tuning", "full"), ("LoRA r=16", "lora")):
            r = row[key]
            if r["status"] != "ok":
                lines.append(f"| {row['devices']} | {name} | {r['status']} |  |  |  |  |  |")
                continue
            mem = [f"{r['memory_bytes'][k] / mib:.2f}" for k in MEMORY]
            ratio = f"{row['step_ratio']:.2f}" if key == "lora" and "step_ratio" in row else ""
            lines.append(
                f"| {row['devices']} | {name} | {' | '.join(mem)} | {r['step_seconds']:.3f} "
                f"| {ratio} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lora", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (median)")
    ap.add_argument("--model", type=json.loads, default=None, help="config overrides, JSON")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result = compare(args.devices, args.seq_len, args.model, args.rounds, steps=args.steps)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
