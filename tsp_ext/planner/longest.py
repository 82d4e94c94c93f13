"""The longest sequence each layout trains within device and host memory (``--max-seq-len``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .inputs import Cluster, Layout, Memory, Workload
from .memory import MEMORY
from .ranking import candidates, check
from .shapes import ModelShape

LIMIT = 1 << 30  # tokens: no layout is searched beyond this


def long_context(kind: str, m: ModelShape, w: Workload, devices: int) -> Workload:
    """``w`` as ``kind`` runs its longest sequences. Every layout checkpoints each decoder
    layer. TSP (``TSPConfig(checkpoint_layers, offload_checkpoints, mlp_tile=h,
    overlap=False)``, the optimizer on the host through DeepSpeed) and ALST (its published
    settings: checkpoints and optimizer on the host, ``TiledMLP`` in tiles of h tokens, the
    weights on the host too on one device) offload; TP, Ulysses and TP×SP run as the benchmark
    harness runs them, checkpointing only."""
    w = replace(w, recompute="full")
    if kind not in ("tsp", "alst"):
        return w
    offload = dict(offload_checkpoints=True, offload_optimizer=True, mlp_tile=m.hidden_size)
    if kind == "tsp":
        return replace(w, overlap=False, **offload)
    return replace(w, offload_params=devices == 1, **offload)


@dataclass(frozen=True)
class Longest:
    """A layout's longest sequence (None: not even the shortest fits), its memory there and
    what stops it growing (``"device"`` or ``"host"`` memory)."""

    layout: Layout
    seq_len: int | None
    memory: Memory | None
    limit: str

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.kind,
            "tp": self.layout.tp,
            "sp": self.layout.sp,
            "max_seq_len": self.seq_len,
            "memory_bytes": None if self.memory is None else self.memory.as_dict(),
            "limit": self.limit,
        }


def longest(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> Longest:
    """The longest sequence (a multiple of the layout's token split: 2D for TSP's zigzag, the
    SP size otherwise) for which ``lay`` fits in ``c``'s device and host memory."""
    step = 2 * lay.tp if lay.kind == "tsp" else lay.sp

    def limit(n: int) -> str | None:
        mem = MEMORY[lay.kind](m, replace(w, seq_len=n * step), lay)
        if mem.total > c.memory_bytes:
            return "device"
        return None if c.host_fits(mem.host) else "host"

    lo, hi = 0, 1
    while hi * step <= LIMIT and limit(hi) is None:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if limit(mid) is None else (lo, mid)
    stop = limit(hi) or "search limit"
    if lo == 0:
        return Longest(lay, None, None, stop)
    mem = MEMORY[lay.kind](m, replace(w, seq_len=lo * step), lay)
    return Longest(lay, lo * step, mem, stop)


def longest_per_layout(
    m: ModelShape, w: Workload, c: Cluster, kinds: tuple[str, ...]
) -> tuple[list[Longest], list[tuple[Layout, str]]]:
    """Every valid layout of ``c.devices`` (one model-parallel group spanning all of them, the
    longest-context arrangement) in its long-context configuration, with its longest
    sequence; and the layouts skipped, with the reason."""
    found, skipped = [], []
    for lay in candidates(c.devices):
        if lay.kind not in kinds or lay.dp != 1:
            continue
        lw = long_context(lay.kind, m, w, c.devices)
        reason = check(m, replace(lw, seq_len=lay.group * 2), lay)
        if reason is None:
            found.append(longest(m, lw, c, lay))
        else:
            skipped.append((lay, reason))
    return found, skipped
