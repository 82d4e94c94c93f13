"""Candidate layouts, their validity checks and estimates, the plan and its recommendation."""

from __future__ import annotations

from .comm import COMM
from .inputs import GIB, LAYOUTS, Cluster, Estimate, Layout, Plan, Workload
from .memory import MEMORY
from .shapes import ModelShape
from .time import step_seconds


def candidates(devices: int) -> list[Layout]:
    """Every TSP, TP, SP and ALST size >= 2 and every TP×SP pair that divides the device count;
    on one device, ALST alone (no SP: ZeRO-3 with its tiling and offload)."""
    sizes = [n for n in range(2, devices + 1) if devices % n == 0]
    out = [Layout("tsp", n, n, devices // n) for n in sizes]
    out += [Layout("tp", n, 1, devices // n) for n in sizes]
    out += [Layout("sp", 1, n, devices // n) for n in sizes]
    out += [
        Layout("tpxsp", a, n // a, devices // n)
        for n in sizes
        for a in sizes
        if n % a == 0 and 2 <= a < n
    ]
    out += [Layout("alst", 1, n, devices // n) for n in sizes or [1]]
    return out


def check(m: ModelShape, w: Workload, lay: Layout) -> str | None:
    """Why ``lay`` cannot run this model and workload (what to change), or None when it can."""
    if lay.kind == "tsp":  # any D up to the number of query heads (shards may be uneven)
        D = lay.tp
        reasons = [
            (
                D > m.num_heads,
                f"tsp={D} exceeds num_heads={m.num_heads}: the largest valid TSP size is "
                f"{m.num_heads}",
            ),
            (D > m.intermediate_size, f"intermediate_size={m.intermediate_size} < tsp={D}"),
            (m.moe and D > m.num_experts, f"num_experts={m.num_experts} < tsp={D}"),
        ]
        return next((msg for bad, msg in reasons if bad), None)
    if lay.tp > 1:
        t = lay.tp
        reasons = [
            (m.num_heads % t, f"num_heads={m.num_heads} is not divisible by tp={t}"),
            (m.num_kv_heads % t, f"num_kv_heads={m.num_kv_heads} is not divisible by tp={t}"),
            (m.intermediate_size % t, f"intermediate_size={m.intermediate_size} % tp={t} != 0"),
        ]
        reason = next((msg for bad, msg in reasons if bad), None)
        if reason:
            return reason
    if lay.sp > 1:
        s, nh, nkv = lay.sp, m.num_heads // lay.tp, m.num_kv_heads // lay.tp
        reasons = [
            (nh % s, f"{nh} query heads per TP rank are not divisible by sp={s}"),
            (
                nkv % s and s % nkv,
                f"{nkv} KV heads per TP rank and sp={s}: one must divide the other",
            ),
            (w.seq_len % s, f"seq_len={w.seq_len} is not divisible by sp={s}"),
        ]
        return next((msg for bad, msg in reasons if bad), None)
    return None


def estimate(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> Estimate:
    """Memory, communication and step time of one layout (assumed valid: see ``check``)."""
    memory = MEMORY[lay.kind](m, w, lay)
    per_layer, per_step = COMM[lay.kind](m, w, c, lay)
    seconds = step_seconds(m, w, c, lay, per_layer=per_layer, per_step=per_step)
    fits = memory.total <= c.memory_bytes and c.host_fits(memory.host)
    return Estimate(
        lay,
        memory=memory,
        per_layer=tuple(per_layer),
        per_step=tuple(per_step),
        step_seconds=seconds,
        fits=fits,
    )


def plan(m: ModelShape, w: Workload, c: Cluster, kinds: tuple[str, ...] = LAYOUTS) -> Plan:
    """Estimate every valid layout of ``c.devices`` and recommend the fastest that fits.

    Raises ``ValueError`` naming what to change when no layout can run at all.
    """
    estimates, skipped = [], []
    for lay in candidates(c.devices):
        if lay.kind not in kinds:
            continue
        reason = check(m, w, lay)
        if reason is None:
            estimates.append(estimate(m, w, c, lay))
        else:
            skipped.append((lay, reason))
    if not estimates:
        why = "; ".join(f"{lay}: {r}" for lay, r in skipped) or "no model-parallel size divides it"
        raise ValueError(
            f"no layout can run {m.name} on {c.devices} devices ({why}): choose --devices with "
            "divisors that divide the model's heads and MLP width (and --seq-len the SP size)"
        )
    recommended, reason = _recommend(estimates, c)
    return Plan(
        m,
        work=w,
        cluster=c,
        estimates=tuple(estimates),
        skipped=tuple(skipped),
        recommended=recommended,
        reason=reason,
    )


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit (KiB to GiB) that keeps it >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _recommend(estimates: list[Estimate], c: Cluster) -> tuple[Estimate | None, str]:
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_seconds)
    if not fitting:
        best = min(estimates, key=lambda e: e.memory.total)
        return None, (
            f"no layout fits in {c.device_memory_gb:g} GiB per device; the smallest, "
            f"{best.layout}, needs {format_bytes(best.memory.total)}: add devices, use "
            "--recompute full, or shorten --seq-len / --micro-batch"
        )
    best = fitting[0]
    why = (
        f"{best.layout}: the lowest estimated step time ({best.step_seconds:.3g} s) of the "
        f"{len(fitting)} layouts that fit in {c.device_memory_gb:g} GiB (it needs "
        f"{format_bytes(best.memory.total)})"
    )
    if len(fitting) > 1:
        nxt = fitting[1]
        why += f"; next: {nxt.layout} at {nxt.step_seconds:.3g} s"
    return best, why
