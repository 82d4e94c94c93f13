"""Longest trainable sequence per layout under one per-rank memory budget, in one run.

    python -m benchmarks.maxlen --devices 2 4 --budget-mib 256 --layouts tsp ulysses tp
    python -m benchmarks.maxlen --devices 2 --budget-mib 256 --time-at 2048 --json out.json
    python -m benchmarks.maxlen --devices 2 --budget-mib 64 --layouts dpo_tsp_long dpo_alst

For each layout and device count D: the longest sequence S (a multiple of ``--granule`` x 2D)
for which one full training step (forward, backward, AdamW update) keeps every rank's memory
within the budget, to within 1/16 of S: doubling from ``--start``, then bisection. A rank's
memory is what the step needs on the device: its parameters and optimizer state plus the step's
rise above them (gradients, saved activations, transients; the harness's ``peak_delta``), not
the process's fixed cost (Python, libraries). Each probe is one harness measurement (a warm-up
step, then the measured one) in fresh processes. ``--time-at S`` also times every layout at
one common S (median of 3 steps). For the DPO layouts (``dpo_layouts``) S is each sequence's
length: a step trains a chosen and a rejected sequence and runs both through the reference.
Ratios are to ``alst``, or to ``dpo_alst`` when DPO layouts are measured.

Prints a markdown table; ``--json`` writes the rows with every probe.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from .harness import measure
from .registry import LAYOUTS, REGISTRY, layouts_help

MIB = 2**20


def rank_bytes(row: dict) -> int:
    """A rank's device memory for the step: state (gradient buffers that outlive the step
    included) plus the step's peak rise (max over ranks); offloaded bytes are host memory."""
    mem = row["memory_bytes"]
    return mem["params"] + mem["optimizer"] + mem.get("resident_grads", 0) + mem["peak_delta"]


def longest(fits: Callable[[int], bool], start: int, granule: int, limit: int) -> int | None:
    """The longest multiple of ``granule`` up to ``limit`` for which ``fits`` holds (``fits``
    true up to some length, false beyond), to within 1/16: doubling from ``start``, then
    bisection. None when ``granule`` itself does not fit."""
    lo, hi, s = 0, None, max(granule, start - start % granule)
    while s <= limit:
        if fits(s):
            lo, s = s, 2 * s
        else:
            hi = s
            break
    if hi is None:
        return lo or None
    while hi - lo > max(granule, lo // 16):
        mid = (lo + hi) // 2 // granule * granule
        if mid <= lo or mid >= hi:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo or None


def search(
    layout: str,
    devices: int,
    budget_bytes: int,
    *,
    start: int = 1024,
    granule: int = 16,
    limit: int = 1 << 20,
    model_cfg: dict | None = None,
    launch: Callable | None = None,
) -> dict:
    """``layout``'s longest S on ``devices`` ranks under ``budget_bytes`` per rank: a row with
    ``max_seq_len`` (None: not even the shortest fits), its memory and every probe."""
    probes: list[dict] = []
    status = "ok"

    def fits(seq_len: int) -> bool:
        nonlocal status
        if status != "ok":  # unsupported: no length fits
            return False
        row = measure(
            layout, devices, seq_len, model_cfg, steps=1, warmup=1, launch=launch,
            release_from_start=True,
        )  # fmt: skip
        ok = row["status"] == "ok"
        used = rank_bytes(row) if ok else None
        host = row["memory_bytes"]["host"] if ok else None
        probes.append({"seq_len": seq_len, "status": row["status"], "bytes": used, "host": host})
        if row["status"].startswith("unsupported"):
            status = row["status"]
        return used is not None and used <= budget_bytes

    step = granule * 2 * devices  # every layout shards S over D ranks (TSP: 2D zigzag chunks)
    best = longest(fits, start, step, limit)
    at_best = next((p for p in probes if p["seq_len"] == best), {})
    return {
        "layout": layout,
        "devices": devices,
        "budget_bytes": budget_bytes,
        "max_seq_len": best,
        "bytes_at_max": at_best.get("bytes"),
        "host_bytes_at_max": at_best.get("host"),
        "status": status,
        "probes": probes,
    }


def markdown(rows: list[dict], versus: str = "alst") -> str:
    """The table: per layout and D its longest S, memory there (device; offloaded checkpoints
    in host memory apart) and step time at the common S, with ratios to ``versus`` at that D."""
    lines = [
        f"| layout | D | max S | vs {versus} | MiB per rank at max S | host MiB at max S "
        f"| step s at common S | vs {versus} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r["devices"]: r for r in rows if r["layout"] == versus}

    def ratio(r: dict, key: str) -> str:
        b = base.get(r["devices"], {}).get(key)
        return f"{r[key] / b:.2f}" if r.get(key) and b else "—"

    for r in rows:
        mib = f"{r['bytes_at_max'] / MIB:.1f}" if r["bytes_at_max"] else "—"
        host = f"{r['host_bytes_at_max'] / MIB:.1f}" if r.get("host_bytes_at_max") else "—"
        step = f"{r['step_seconds']:.3f}" if r.get("step_seconds") else "—"
        best = r["max_seq_len"] if r["status"] == "ok" else r["status"]
        lines.append(
            f"| {r['layout']} | {r['devices']} | {best} | {ratio(r, 'max_seq_len')} | {mib} "
            f"| {host} | {step} | {ratio(r, 'step_seconds')} |"
        )
    return "\n".join(lines)


def baseline(layouts: list[str]) -> str:
    """The layout the table's ratios are to: ALST, or DPO on the ALST path for DPO layouts."""
    return "dpo_alst" if any(REGISTRY[name].preference for name in layouts) else "alst"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=layouts_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--devices", type=int, nargs="+", default=[2])
    p.add_argument("--budget-mib", type=float, required=True, help="per-rank memory budget")
    p.add_argument("--layouts", nargs="+", default=["tsp", "ulysses", "tp"], choices=LAYOUTS)
    p.add_argument("--start", type=int, default=1024, help="first sequence length tried")
    p.add_argument("--granule", type=int, default=16, help="S is a multiple of this x 2D")
    p.add_argument("--limit", type=int, default=1 << 20, help="longest S tried")
    p.add_argument("--time-at", type=int, default=None, help="also time every layout at this S")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.budget_mib <= 0:
        raise SystemExit(f"--budget-mib {args.budget_mib}: give a positive budget")
    rows = []
    for devices in args.devices:
        for layout in args.layouts:
            row = search(
                layout, devices, int(args.budget_mib * MIB), start=args.start,
                granule=args.granule, limit=args.limit,
            )  # fmt: skip
            if args.time_at and row["status"] == "ok":
                timed = measure(layout, devices, args.time_at, steps=3, warmup=1)
                row["step_seconds"] = timed.get("step_seconds")
            rows.append(row)
            print(f"{layout} D={devices}: max S {row['max_seq_len']} ({row['status']})", flush=True)
    if all(r["max_seq_len"] is None for r in rows):
        raise SystemExit(
            f"no layout trains even S = {2 * args.granule * min(args.devices)} within "
            f"{args.budget_mib} MiB per rank: raise --budget-mib or lower --granule"
        )
    print(markdown(rows, versus=baseline(args.layouts)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
