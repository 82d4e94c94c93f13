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


# TSP's memory options the planner chooses among for its longest sequence (``choose``):
# intervals of k layers, head buckets of one KV head, and a device tier of the checkpoints
CHECKPOINT_EVERY = (1, 2, 3, 4)
HEAD_BUCKETS = (None, 1)


@dataclass(frozen=True)
class Longest:
    """A layout's longest sequence (None: not even the shortest fits), its memory there, what
    stops it growing (``"device"`` or ``"host"`` memory) and, for TSP, the ``TSPConfig``
    memory options it runs with (``options``)."""

    layout: Layout
    seq_len: int | None
    memory: Memory | None
    limit: str
    options: dict | None = None

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.kind,
            "tp": self.layout.tp,
            "sp": self.layout.sp,
            "max_seq_len": self.seq_len,
            "memory_bytes": None if self.memory is None else self.memory.as_dict(),
            "limit": self.limit,
            **({} if self.options is None else {"tsp_options": self.options}),
        }


def _tier_memory(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> tuple[Memory, Workload]:
    """TSP's memory at ``w`` with a device tier of what the device has spare (the bytes of
    checkpoints moved from the host to the device), and the workload with that tier."""
    mem = MEMORY[lay.kind](m, w, lay)
    spare = c.memory_bytes - mem.total
    if spare <= 0 or mem.host <= 0:
        return mem, w
    tiered = MEMORY[lay.kind](m, replace(w, checkpoint_device_bytes=spare), lay)
    moved = mem.host - tiered.host  # what the tier took, at most the checkpoints
    w = replace(w, checkpoint_device_bytes=moved)
    return MEMORY[lay.kind](m, w, lay), w


def longest(
    m: ModelShape, w: Workload, c: Cluster, lay: Layout, device_tier: bool = False
) -> Longest:
    """The longest sequence (a multiple of the layout's token split: 2D for TSP's zigzag, the
    SP size otherwise) for which ``lay`` fits in ``c``'s device and host memory.
    ``device_tier`` (TSP with offloaded checkpoints): at each length the device keeps what room
    it has left of the checkpoints (``checkpoint_device_bytes``), the host the rest."""
    step = 2 * lay.tp if lay.kind == "tsp" else lay.sp

    def at(n: int) -> tuple[Memory, Workload]:
        wn = replace(w, seq_len=n * step)
        if device_tier:
            return _tier_memory(m, wn, c, lay)
        return MEMORY[lay.kind](m, wn, lay), wn

    def limit(n: int) -> str | None:
        mem = at(n)[0]
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
    mem, wl = at(lo)
    options = None
    if lay.kind == "tsp":
        options = {
            "checkpoint_every": wl.checkpoint_every,
            "head_bucket": wl.head_bucket,
            "checkpoint_device_bytes": int(wl.checkpoint_device_bytes),
        }
    return Longest(lay, seq_len=lo * step, memory=mem, limit=stop, options=options)


def longest_tsp(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> Longest:
    """TSP's longest sequence over its memory options (``CHECKPOINT_EVERY`` x ``HEAD_BUCKETS``
    x a device tier or none): the longest, and of equal ones the first in that order (fewer
    recomputed forwards, whole head groups, no tier: the faster step)."""
    best = None
    for every in CHECKPOINT_EVERY:
        for bucket in HEAD_BUCKETS:
            for tier in (False, True):
                wk = replace(w, checkpoint_every=every, head_bucket=bucket)
                found = longest(m, wk, c, lay, device_tier=tier)
                if best is None or (found.seq_len or 0) > (best.seq_len or 0):
                    best = found
    return best


def longest_per_layout(
    m: ModelShape, w: Workload, c: Cluster, kinds: tuple[str, ...], choose: bool = False
) -> tuple[list[Longest], list[tuple[Layout, str]]]:
    """Every valid layout of ``c.devices`` (one model-parallel group spanning all of them, the
    longest-context arrangement) in its long-context configuration, with its longest
    sequence; and the layouts skipped, with the reason. ``choose``: TSP's memory options are
    the planner's choice (``longest_tsp``), else ``w``'s."""
    found, skipped = [], []
    for lay in candidates(c.devices):
        if lay.kind not in kinds or lay.dp != 1:
            continue
        lw = long_context(lay.kind, m, w, c.devices)
        reason = check(m, replace(lw, seq_len=lay.group * 2), lay)
        if reason is None:
            pick = longest_tsp if choose and lay.kind == "tsp" else longest
            found.append(pick(m, lw, c, lay))
        else:
            skipped.append((lay, reason))
    return found, skipped
