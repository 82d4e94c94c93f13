"""Result rows to a markdown table, with each layout's loss checked against ``single``."""

from __future__ import annotations

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


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def markdown_table(rows: list[dict]) -> str:
    """One line per row: memory per rank (MiB), communication per rank per step, time, loss."""
    head = (
        "| layout | D | tp×sp | seq | status | params+grads+optim | activations | peak Δ | peak | "
        "comm received / step | step s | tokens/s | loss vs single |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["devices"], r["layout"])):
        cells = [r["layout"], str(r["devices"]), f"{r['tp']}×{r['sp']}", str(r["seq_len"])]
        if r["status"] != "ok":
            lines.append("| " + " | ".join(cells + [r["status"]] + [""] * 8) + " |")
            continue
        m, comm = r["memory_bytes"], r["comm_bytes"]
        detail = " ".join(f"{_SHORT.get(k, k)} {_mib(v)}" for k, v in comm.items() if v)
        total = sum(comm.values())
        diff = r.get("loss_rel_diff")
        cells += [
            "ok",
            _mib(m["params"] + m["grads"] + m["optimizer"]),
            _mib(m["activations"]),
            _mib(m["peak_delta"]),
            _mib(m["peak"]),
            f"{_mib(total)} ({detail})" if total else "0",
            f"{r['step_seconds']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            "" if diff is None else f"{diff:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"
