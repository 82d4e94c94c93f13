"""Benchmark sweep: every layout at every device count and sequence length, one command.

    python -m benchmarks.run                       # full sweep on CPU/gloo
    python -m benchmarks.run --quick               # a short smoke sweep
    python -m benchmarks.run --devices 4 --seq-lens 4096 16384 --layouts single tsp tp \\
        --json out.json --markdown out.md --plots plots/
    python -m benchmarks.run --device cuda         # NCCL, one GPU per rank
    python -m benchmarks.run --devices 2 --seq-lens 4096 --layouts single tsp ulysses --rounds 3

Writes the rows as JSON (``--json``), a markdown table (``--markdown``, also printed) and PNG plots
(``--plots``). A layout that cannot run a device count (tpxsp below 4) is skipped; a layout found
unsupported or out of memory at one length is not retried at longer ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from .harness import measure
from .plots import write_plots
from .registry import SWEEP_LAYOUTS, TRAINING_LAYOUTS, layouts_help, tp_sp_split
from .report import add_loss_check, add_ulysses_ratio, markdown_table

log = logging.getLogger("benchmarks")

DEFAULT_SEQ_LENS = (2048, 4096, 8192)
QUICK_SEQ_LENS = (512, 1024)


def sweep(
    layouts: list[str],
    devices: list[int],
    seq_lens: list[int],
    model_cfg: dict | None = None,
    rounds: int = 1,
    **kwargs,
) -> list[dict]:
    """Rows of ``measure`` for every (sequence length, device count, layout); ``single`` once per
    length. With ``rounds > 1`` the layouts of one (length, device count) run in turn, ``rounds``
    times over, and each row holds the medians (``combine_rounds``): a drift of the machine
    between runs then touches every layout alike. ``kwargs`` go to ``measure``."""
    rows, dead = [], {}
    for S in seq_lens:
        for D in devices:
            runs: dict[str, list[dict]] = {}
            for _ in range(rounds):
                for layout in layouts:
                    if layout == "single" and D != devices[0]:
                        continue
                    try:
                        tp_sp_split(layout, D)
                    except ValueError as e:
                        log.info("skip %s at D=%d: %s", layout, D, e)
                        continue
                    key = (layout, 1 if layout == "single" else D)
                    if key in dead:
                        log.info("skip %s D=%d S=%d: %s earlier", layout, D, S, dead[key])
                        continue
                    t0 = time.monotonic()
                    row = measure(layout, D, S, model_cfg, **kwargs)
                    log.info(
                        "%s D=%d S=%d: %s (%.0f s)",
                        layout,
                        D,
                        S,
                        row["status"],
                        time.monotonic() - t0,
                    )
                    if row["status"] != "ok":
                        dead[key] = row["status"]
                    runs.setdefault(layout, []).append(row)
            rows.extend(combine_rounds(r) for r in runs.values())
    return add_ulysses_ratio(add_loss_check(rows))


def combine_rounds(rows: list[dict]) -> dict:
    """One row from the rounds of one layout: the median step time and memory peaks, every
    round's step time in ``step_seconds_rounds``; a failed round's row if any failed."""
    failed = [r for r in rows if r["status"] != "ok"]
    if failed or len(rows) == 1:
        return failed[0] if failed else rows[0]
    row = dict(rows[0])
    row["step_seconds_rounds"] = [r["step_seconds"] for r in rows]
    row["step_seconds"] = statistics.median(row["step_seconds_rounds"])
    row["tokens_per_s"] = row["micro_batch"] * row["seq_len"] / row["step_seconds"]
    row["memory_bytes"] = {
        k: statistics.median(r["memory_bytes"][k] for r in rows) for k in row["memory_bytes"]
    }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n")[0],
        epilog=layouts_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None)
    ap.add_argument("--layouts", nargs="+", default=list(SWEEP_LAYOUTS), choices=TRAINING_LAYOUTS)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--rounds", type=int, default=1, help="run the layouts in turn this many times (medians)"
    )
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument(
        "--model",
        type=json.loads,
        default=None,
        help="config overrides, JSON: '{\"hidden_size\": 512}'",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help=f"seq lens {QUICK_SEQ_LENS}, 1 layer")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--plots", help="write PNG plots into this folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    seq_lens = args.seq_lens or (QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS)
    model = {**({"num_hidden_layers": 1} if args.quick else {}), **(args.model or {})}
    t0 = time.monotonic()
    rows = sweep(
        args.layouts,
        sorted(args.devices),
        list(seq_lens),
        model,
        rounds=args.rounds,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=args.warmup,
        dtype=args.dtype,
        device=args.device,
    )
    log.info("sweep took %.0f s", time.monotonic() - t0)
    table = markdown_table(rows)
    sys.stdout.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.plots:
        for path in write_plots(rows, args.plots):
            log.info("wrote %s", path)
    bad = [r for r in rows if r.get("loss_rel_diff", 0) > 1e-4 and r["dtype"] == "float32"]
    for r in bad:
        log.error(
            "%s D=%d S=%d: loss differs from single by %.1e",
            r["layout"],
            r["devices"],
            r["seq_len"],
            r["loss_rel_diff"],
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
