"""LoRA and QLoRA against full fine-tuning under TSP: memory per rank, weight traffic and step
time, one run.

    python -m benchmarks.lora --devices 2 4 --seq-len 2048 --rounds 3 \\
        --model '{"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                  "num_key_value_heads": 16}' --json docs/benchmarks/lora_cpu.json

The layouts (``tsp``, ``tsp_lora``: r = 16 on all seven projections, ``layouts.LORA``, and
``tsp_qlora``: that with the frozen base NF4-packed) train the same model on the same batch, in
turn, ``--rounds`` times over (medians), so a drift of the machine touches them alike. Per device
count the table gives each one's bytes per rank (parameters and buffers, gradients, optimizer
state, saved activations), the bytes it receives by head-group broadcast and on the ring (the
weights' traffic: MLP and LM-head shards, gradient accumulators) and its step time as a ratio
of full fine-tuning's, beside the ratio the multiply-adds alone would give (``flop_floor``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .harness import measure
from .layouts import LORA
from .run import combine_rounds

LAYOUTS = {"tsp": "full fine-tuning", "tsp_lora": "LoRA r=16", "tsp_qlora": "QLoRA r=16 (NF4)"}
MEMORY = ("params", "grads", "optimizer", "activations")
TRAFFIC = ("broadcast", "send_recv")


def flop_floor(model: dict, seq_len: int, devices: int) -> float:
    """LoRA's step over full fine-tuning's counting multiply-adds only, as the engine runs them.
    Per token and layer, full fine-tuning runs q/k/v and gate/up 4 times (forward, backward's
    recompute, dX, dW) and o and down 3 times; causal attention costs ``3.5 · q_dim · S`` (the
    forward's QKᵀ and PV over S/2 keys on average, the kernel's backward 2.5 times that); the LM
    head runs ``2 + (D-1)/D`` times (the ring recomputes the logits of D-1 shards) plus dW. A
    frozen weight skips its dW pass; the adapter's own rank-r products are left out."""
    h, f, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
    heads = model["num_attention_heads"]
    head_dim = model.get("head_dim") or h // heads
    q_dim, kv_dim = heads * head_dim, model["num_key_value_heads"] * head_dim
    recomputed = h * (q_dim + 2 * kv_dim) + 2 * h * f  # q/k/v, gate/up
    once = q_dim * h + f * h  # o, down
    head = h * model["vocab_size"] * (2 + (devices - 1) / devices)
    attention = 3.5 * q_dim * seq_len
    lora = layers * (3 * recomputed + 2 * once + attention) + head
    full = lora + layers * (recomputed + once) + h * model["vocab_size"]
    return lora / full


def compare(
    devices: list[int], seq_len: int, model_cfg=None, rounds: int = 3, layouts=tuple(LAYOUTS), **kw
) -> dict:
    """``{"lora": LORA, "rows": [...]}``: per device count one row holding each layout's result
    (``measure``'s row, medians over the rounds) and the step-time ratios to ``tsp``'s."""
    rows = []
    for D in devices:
        runs: dict[str, list[dict]] = {name: [] for name in layouts}
        for _ in range(rounds):
            for name in layouts:
                runs[name].append(measure(name, D, seq_len, model_cfg, **kw))
        row = {"devices": D, "seq_len": seq_len}
        row.update({name: combine_rounds(r) for name, r in runs.items()})
        full = row.get("tsp")
        for name in layouts:
            if full and full["status"] == row[name]["status"] == "ok":
                row[name]["step_ratio"] = row[name]["step_seconds"] / full["step_seconds"]
        rows.append(row)
    return {"lora": LORA, "rows": rows}


def markdown(result: dict) -> str:
    mib = 2**20
    head = " | ".join(f"{k} MiB" for k in (*MEMORY, "broadcast", "ring"))
    lines = [f"| D | layout | {head} | step s | / full step | FLOP floor |", "|---" * 11 + "|"]
    for row in result["rows"]:
        for name, label in LAYOUTS.items():
            r = row.get(name)
            if r is None:
                continue
            if r["status"] != "ok":
                lines.append(f"| {row['devices']} | {label} | {r['status']} |" + " |" * 9)
                continue
            cells = [r["memory_bytes"][k] for k in MEMORY]
            cells += [r["comm_bytes"].get(k, 0) for k in TRAFFIC]
            cells = [f"{c / mib:.2f}" for c in cells]
            ratio = f"{r['step_ratio']:.2f}" if "step_ratio" in r else ""
            floor = (
                ""
                if name == "tsp"
                else f"{flop_floor(r['model'], row['seq_len'], row['devices']):.2f}"
            )
            lines.append(
                f"| {row['devices']} | {label} | {' | '.join(cells)} | {r['step_seconds']:.3f} "
                f"| {ratio} | {floor} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lora", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (median)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", type=json.loads, default=None, help="config overrides, JSON")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result = compare(
        args.devices, args.seq_len, args.model, args.rounds, tuple(args.layouts),
        steps=args.steps, dtype=args.dtype,
    )  # fmt: skip
    result["dtype"] = args.dtype
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
