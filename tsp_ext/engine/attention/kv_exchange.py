"""A head group's K/V on the move: the sequence all-gather (or, under a sliding window, the
``WindowExchange`` of only the keys each rank's queries see), its dual for dK/dV, and the sum of a
shared KV head's gradient over the groups using it.

Each rank projects K/V for its local tokens (zigzag chunks p and 2D-1-p), heads-major ``[B, 2hk,
T, d]`` (K's heads, then V's). The all-gather brings every rank's and ``natural_kv`` lays them out
in token order; the backward turns dK/dV back into that rank-major layout (``rank_major``) and
reduce-scatters it, so each rank gets its own rows summed over every rank that read them. A group
whose query heads do not map onto its KV heads as the kernels' GQA does gets them expanded
(``expand_kv``) and their gradients folded back (``fold_kv``).
"""

from __future__ import annotations

import torch

from ..parallel import comm
from ..sharding.layout import ZigzagLayout, chunk_owner
from .heads import KV_SHARDS, AttentionSpec
from .qkv import split_kv
from .window import WindowExchange


def _pieces(layout: ZigzagLayout, keys: slice) -> list[tuple[int, slice, slice]]:
    """Where the token positions ``keys`` lie in rank-major rows ``[D, .., T, ..]``: ``(q,
    rows of rank q, the same positions relative to keys.start)`` per zigzag chunk they cover,
    in token order."""
    c, D = layout.chunk, layout.size
    out = []
    for j in range(keys.start // c, -(-keys.stop // c)):
        q, slot = chunk_owner(j, D)
        offset = slot * c
        lo, hi = max(j * c, keys.start), min((j + 1) * c, keys.stop)
        rows = slice(offset + lo - j * c, offset + hi - j * c)
        out.append((q, rows, slice(lo - keys.start, hi - keys.start)))
    return out


class RankMajorGrads:
    """dK and dV of all S keys accumulated where the reduce-scatter sends them from: ``buf [D, B,
    2hk, T, d]`` (rank q's rows, K's heads then V's; the accumulation dtype). A key range in
    token order is added into the zigzag chunks it covers, so no token-order copy of the
    gradients is made."""

    def __init__(self, layout: ZigzagLayout, hk: int, buf: torch.Tensor) -> None:
        self.layout, self.hk, self.buf = layout, hk, buf

    @classmethod
    def zeros(cls, layout: ZigzagLayout, B: int, hk: int, d: int, dtype, device):
        buf = torch.zeros(layout.size, B, 2 * hk, layout.local_len, d, dtype=dtype, device=device)
        return cls(layout, hk, buf)

    def rows(self, b: int) -> RankMajorGrads:
        """The same accumulator for batch row ``b`` alone."""
        return RankMajorGrads(self.layout, self.hk, self.buf[:, b : b + 1])

    def add(self, values: bool, keys: slice, g: torch.Tensor) -> None:
        """Add ``g [B, L, hk, d]``, the gradient of the keys (``values``: of the values) at
        token positions ``keys``."""
        heads = slice(self.hk, 2 * self.hk) if values else slice(0, self.hk)
        for q, rows, part in _pieces(self.layout, keys):
            self.buf[q, :, heads, rows].add_(g[:, part].transpose(1, 2))


class KVExchange:
    """How one call's K/V travel: the all-gather of the whole sequence (``window`` None), or the
    window's exchange. ``lean``: reduce-scatter without a second buffer of the sent rows where
    the backend would make one (gloo's faster path), memory before speed."""

    def __init__(
        self,
        layout: ZigzagLayout,
        window: WindowExchange | None,
        group,
        acc: torch.dtype,
        lean: bool = False,
    ) -> None:
        self.layout, self.window, self.group, self.acc = layout, window, group, acc
        self.lean = lean

    def grads_into(self, B: int, hk: int, d: int, device) -> RankMajorGrads | None:
        """Where one bucket's dK/dV accumulate for ``scatter_from``: in the all-gather's
        rank-major layout, or None under a window (``scatter`` of per-segment gradients)."""
        if self.window is not None:
            return None
        return RankMajorGrads.zeros(self.layout, B, hk, d, dtype=self.acc, device=device)

    def scatter_from(self, grads: RankMajorGrads):
        """``scatter`` of gradients accumulated in place: ``(dkv [B, 2hk, T, d], handle)``."""
        return comm.reduce_scatter_seq(grads.buf, self.group, True, lean=self.lean)

    def gather(self, kv: torch.Tensor):
        """Post the exchange of this rank's ``kv [B, 2hk, T, d]``: ``(gathered, handle)``;
        ``segments(gathered)`` once the handle has been waited for."""
        if self.window is None:
            return comm.all_gather_seq(kv, self.group, async_op=True)
        return self.window.gather(kv, self.group)

    def segments(self, gathered) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """K/V segments ``(base, K, V [B, L, hk, d])`` of what arrived (heads-major): one of
        all S keys from the all-gather (``natural_kv``), or the window's key ranges."""
        if self.window is None:
            return [(0, *self.natural_kv(gathered))]
        return [(base, *split_kv(kv)) for base, kv in gathered.segments()]

    def scatter(self, grads: list[tuple[torch.Tensor, torch.Tensor]]):
        """Dual of the exchange: dK, dV per segment -> ``(dkv [B, 2hk, T, d] in acc, handle)``,
        this rank's rows summed over every rank that read them."""
        if self.window is None:
            return comm.reduce_scatter_seq(self.rank_major(*grads[0]), self.group, True)
        heads_major = [torch.cat([dk, dv], dim=2).transpose(1, 2) for dk, dv in grads]
        return self.window.scatter(heads_major, self.acc, self.group)

    def natural_kv(self, kv_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered ``kv_all [D, B, 2hk, T, d]`` (rank-major, heads-major) -> K, V ``[B, S, hk,
        d]`` in token order (one copy of contiguous blocks: rank q's chunks q and 2D-1-q go to
        their global positions), stored heads-major (see ``heads_major``)."""
        D, B, two_hk, T, d = kv_all.shape
        kv = kv_all.new_empty(B, two_hk, D * T, d)
        for q in range(D):
            for s in self.layout.spans(q):
                kv[:, :, s.start : s.stop] = kv_all[q, :, :, s.offset : s.offset + s.length]
        return split_kv(kv)

    def rank_major(self, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """Inverse of ``natural_kv`` for gradients: dK, dV ``[B, S, hk, d]`` -> ``[D, B, 2hk, T,
        d]`` in the accumulation dtype, ready to reduce-scatter."""
        B, S, hk, d = dk.shape
        D = self.layout.size
        out = dk.new_empty(D, B, 2 * hk, S // D, d, dtype=self.acc)
        for q in range(D):
            for s in self.layout.spans(q):
                rows = out[q, :, :, s.offset : s.offset + s.length]
                rows[:, :hk] = dk[:, s.start : s.stop].transpose(1, 2)
                rows[:, hk:] = dv[:, s.start : s.stop].transpose(1, 2)
        return out


def share_kv(grads: dict[str, torch.Tensor], spec: AttentionSpec, p: int, group) -> None:
    """Sum, in place, the K/V gradient rows (``KV_SHARDS`` in ``grads``) of each of group ``p``'s
    shared KV heads over the groups using it (``spec.shared_kv``: D > n_kv_heads, or a group
    boundary inside a KV head's query heads), point to point among those ranks only, so that the
    copies stay equal; each rank sends at most its own rows."""
    d = spec.head_dim
    kv = [n for n in grads if n in KV_SHARDS]
    for i, users in spec.shared_kv(p):  # in head order: every user visits them alike
        rows = [grads[n][i * d : (i + 1) * d] for n in kv]
        buf = comm.pack(rows)
        comm.sum_among(buf, users, group)
        for row, total in zip(rows, comm.unpack(buf, [r.shape for r in rows])):
            row.copy_(total)


def heads_major(t: torch.Tensor) -> torch.Tensor:
    """The same ``[B, L, H, d]`` values stored as ``[B, H, L, d]`` (returned as a ``[B, L, H, d]``
    view): the fused kernels run up to 2x faster on that layout, GQA backward most of all."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def expand_kv(k: torch.Tensor, v: torch.Tensor, kv_map: list[int] | None):
    """K, V ``[B, S, hk, d]`` -> ``[B, S, hq, d]`` with query head j's KV head at position j
    (heads-major), when the group's map is not the kernels' GQA map; unchanged otherwise."""
    if kv_map is None:
        return k, v
    index = torch.tensor(kv_map, device=k.device)
    return heads_major(k.index_select(2, index)), heads_major(v.index_select(2, index))


def fold_kv(dk: torch.Tensor, kv_map: list[int] | None, hk: int) -> torch.Tensor:
    """Dual of ``expand_kv`` for a gradient: ``[B, S, hq, d]`` -> ``[B, S, hk, d]``, summed over
    the query heads sharing each KV head."""
    if kv_map is None:
        return dk
    index = torch.tensor(kv_map, device=dk.device)
    return dk.new_zeros(*dk.shape[:2], hk, dk.shape[3]).index_add_(2, index, dk)
