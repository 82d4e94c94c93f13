"""The rows of a benchmark that runs one model on several paths (one process, TSP, other
sequence-parallel libraries): a failure recorded with where it was raised, and one row per path
and D merged over its ranks (``benchmarks.vision``, ``benchmarks.gpt_oss``)."""

from __future__ import annotations

import traceback
from pathlib import Path

EXACT = ("1 process", "tsp")  # paths whose loss must be the single process's


def failure(e: BaseException) -> dict:
    """``{"error": "Type: first line", "where": "file:line function"}`` of an exception, at the
    model's code that raised it (else the library's)."""
    tb = [f for f in traceback.extract_tb(e.__traceback__) if not f.name.startswith("<")]
    frames = [f for f in tb if "/models/" in f.filename]
    frames = frames or [f for f in tb if "site-packages" in f.filename]
    f = frames[-1] if frames else None
    where = f"{Path(f.filename).name}:{f.lineno} {f.name}" if f else ""
    return {"error": f"{type(e).__name__}: {e}".splitlines()[0], "where": where}


def merged_row(name: str, D: int, per_rank: list[dict], single: dict | None) -> dict:
    """One path's row at ``D``: its ranks' errors, or the largest of each measurement over
    the ranks, the first rank's loss, the step-time ratio to ``single`` (the one-process row's
    measurements) and whether every rank's loss is the single process's within 1e-5 relative
    (asserted for the exact paths)."""
    rows = [r[name] if name in r else r for r in per_rank]
    rows = [r for r in rows if r]
    errors = sorted({r["error"] for r in rows if "error" in r})
    if errors:
        where = sorted({r["where"] for r in rows if r.get("where")})
        return {"D": D, "path": name, "ok": False, "error": " | ".join(errors), "where": where}
    row = {k: max(r[k] for r in rows) for k in rows[0]}
    row["loss"] = rows[0]["loss"]
    if single is not None:
        row["vs_1_process"] = row["step_s"] / single["step_s"]
        tol = 1e-5 * max(1.0, abs(single["loss"]))
        row["loss_ok"] = all(abs(r["loss"] - single["loss"]) <= tol for r in rows)
        assert row["loss_ok"] or name not in EXACT, (
            f"{name} D={D}: losses {[r['loss'] for r in rows]} != {single['loss']}"
        )
    return {"D": D, "path": name, "ok": True, **row}
