"""Result rows to a markdown table, with each layout's loss checked against ``single`` and its
step time set against Ulysses'."""

from __future__ import annotations

import statistics

MiB = 2**20
# short names of the collective types in the table
_SHORT = {
    "all_gather": "ag",
    "reduce_scatter": "rs",
    "all_reduce": "ar",
    "all_to_all": "a2a",
    "broadcast": "bc",
    "reduce": "red",
    "send_recv": "p2p",
    "scatter": "sc",
    "gather": "ga",
}


def add_loss_check(rows: list[dict]) -> list[dict]:
    """Set ``loss_rel_diff`` (|loss − single| / single, first and final step, the larger) on every
    ok row that has an ok ``single`` row of the same sequence length and micro-batch."""
    ref = {
        (r["seq_len"], r["micro_batch"]): r
        for r in rows
        if r["layout"] == "single" and r["status"] == "ok"
    }
    for r in rows:
        single = ref.get((r["seq_len"], r["micro_batch"]))
        if r["status"] == "ok" and single is not None:
            r["loss_rel_diff"] = max(
                abs(r[k] - single[k]) / abs(single[k]) for k in ("loss", "final_loss")
            )
    return rows


def add_ulysses_ratio(rows: list[dict]) -> list[dict]:
    """Set ``vs_ulysses`` on every ok row that has an ok ``ulysses`` row of the same device count,
    sequence length and micro-batch: the median over rounds of the two step times' ratio within
    a round (the layouts of a round run back to back, so a drift of the machine between rounds
    cancels), or the ratio of the step times when the rows hold no rounds."""
    ref = {
        (r["devices"], r["seq_len"], r["micro_batch"]): r
        for r in rows
        if r["layout"] == "ulysses" and r["status"] == "ok"
    }
    for r in rows:
        u = ref.get((r["devices"], r["seq_len"], r["micro_batch"]))
        if r["status"] != "ok" or u is None:
            continue
        a, b = r.get("step_seconds_rounds"), u.get("step_seconds_rounds")
        if a and b and len(a) == len(b):
            r["vs_ulysses"] = statistics.median(x / y for x, y in zip(a, b))
        else:
            r["vs_ulysses"] = r["step_seconds"] / u["step_seconds"]
    return rows


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def markdown_table(rows: list[dict]) -> str:
    """One line per row: memory per rank (MiB), communication per rank per step, time, loss."""
    head = (
        "| layout | D | tp×sp | seq | status | params+grads+optim | activations | peak Δ | peak | "
        "comm received / step | step s | vs Ulysses | tokens/s | loss vs single |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["devices"], r["layout"])):
        cells = [r["layout"], str(r["devices"]), f"{r['tp']}×{r['sp']}", str(r["seq_len"])]
        if r["status"] != "ok":
            lines.append("| " + " | ".join(cells + [r["status"]] + [""] * 9) + " |")
            continue
        m, comm = r["memory_bytes"], r["comm_bytes"]
        detail = " ".join(f"{_SHORT.get(k, k)} {_mib(v)}" for k, v in comm.items() if v)
        total = sum(comm.values())
        diff, ratio = r.get("loss_rel_diff"), r.get("vs_ulysses")
        cells += [
            "ok",
            _mib(m["params"] + m["grads"] + m["optimizer"]),
            _mib(m["activations"]),
            _mib(m["peak_delta"]),
            _mib(m["peak"]),
            f"{_mib(total)} ({detail})" if total else "0",
            f"{r['step_seconds']:.3f}",
            "" if ratio is None else f"{ratio:.3f}",
            f"{r['tokens_per_s']:.0f}",
            "" if diff is None else f"{diff:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"
