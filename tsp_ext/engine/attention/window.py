"""Sliding-window K/V exchange: a rank receives only the keys its own queries can see.

Under a window W (query i sees keys ``(i - W, i]``) rank p's zigzag chunk at positions ``[s,
s+c)`` needs the keys ``[s-W+1, s+c)``, not the whole sequence. Each rank's chunks give its
*segments* (key ranges, merged where they touch); every segment is a list of *pieces*, runs of
consecutive positions inside one chunk, so one owner. The forward sends each piece from its owner
(point to point, one buffer per pair of ranks); the backward sends each piece's dK/dV back and the
owner adds it to its own rows (the dual: a reduce-scatter restricted to the pieces).

At S = 8W and D = 4 (c = W) a rank receives about 2W of the 6W tokens an all-gather brings.
``WindowExchange.for_layout`` returns None where the exchange would save less than half of the
all-gather's traffic (windows over most of the sequence).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.comm import Pending
from ..sharding.layout import ZigzagLayout


@dataclass(frozen=True)
class Piece:
    """Positions ``[start, start+length)``: rows ``[src_row, ...)`` of rank ``src``'s local K/V,
    rows ``[dst_row, ...)`` of segment ``segment`` of rank ``dst``."""

    start: int
    length: int
    src: int
    src_row: int
    dst: int
    segment: int
    dst_row: int


class WindowExchange:
    """The segments and pieces of every rank for one layout and window (the same on all ranks)."""

    def __init__(self, layout: ZigzagLayout, window: int) -> None:
        self.layout, self.window = layout, window
        self.bounds = [self._segments(p) for p in range(layout.size)]
        self.pieces = [
            piece
            for p in range(layout.size)
            for j, (base, stop) in enumerate(self.bounds[p])
            for piece in self._cut(p, j, base, stop)
        ]
        self._pairs: dict[tuple[int, int], list[Piece]] = {}
        for x in self.pieces:  # in the same order on every rank: one message per pair
            self._pairs.setdefault((x.src, x.dst), []).append(x)

    @staticmethod
    @functools.cache
    def for_layout(layout: ZigzagLayout, window: int | None) -> WindowExchange | None:
        """The exchange, or None: no window, D = 1, or it moves more than half the rows of the
        all-gather (``D (D-1) S/D``), which is one collective where the exchange is up to
        2(D-1) point-to-point messages per rank. Cached: every layer of a step asks alike."""
        if window is None or layout.size == 1:
            return None
        exchange = WindowExchange(layout, window)
        full = layout.size * (layout.size - 1) * layout.local_len
        return exchange if 2 * exchange.moved_rows() <= full else None

    def _segments(self, p: int) -> list[tuple[int, int]]:
        """Key ranges ``(base, stop)`` rank ``p``'s queries see, in order, merged where they
        touch."""
        out: list[list[int]] = []
        for s in self.layout.spans(p):
            base = max(0, s.start - self.window + 1)
            if out and base <= out[-1][1]:
                out[-1][1] = s.stop
            else:
                out.append([base, s.stop])
        return [(b, e) for b, e in out]

    def _cut(self, p: int, j: int, base: int, stop: int) -> list[Piece]:
        """Segment ``j = [base, stop)`` of rank ``p`` as pieces, one per chunk it touches."""
        c, D = self.layout.chunk, self.layout.size
        pieces = []
        for chunk in range(base // c, (stop - 1) // c + 1):
            start, end = max(base, chunk * c), min(stop, (chunk + 1) * c)
            owner = chunk if chunk < D else 2 * D - 1 - chunk
            row = (0 if chunk < D else c) + start - chunk * c  # chunk p first, then 2D-1-p
            pieces.append(
                Piece(
                    start=start,
                    length=end - start,
                    src=owner,
                    src_row=row,
                    dst=p,
                    segment=j,
                    dst_row=start - base,
                )
            )
        return pieces

    def moved_rows(self, dst: int | None = None) -> int:
        """Rows received from other ranks (by ``dst``, or by all ranks)."""
        return sum(
            x.length for x in self.pieces if x.src != x.dst and (dst is None or x.dst == dst)
        )

    def _between(self, src: int, dst: int) -> list[Piece]:
        return self._pairs.get((src, dst), [])

    def gather(self, kv: torch.Tensor, group) -> tuple[_Gathered, Pending]:
        """Post the exchange of this rank's ``kv [B, 2hk, T, d]`` (heads-major); returns what
        ``segments`` reads once the handle has been waited for."""
        p, D = dist.get_rank(group), self.layout.size
        B, two_hk, _, d = kv.shape
        segs = [kv.new_empty(B, two_hk, e - b, d) for b, e in self.bounds[p]]
        ops, received = [], []
        for x in self._between(p, p):
            segs[x.segment][:, :, x.dst_row : x.dst_row + x.length] = _rows(kv, x.src_row, x)
        for q in range(D):
            if q == p:
                continue
            out, into = self._between(p, q), self._between(q, p)
            if out:
                buf = torch.cat([_rows(kv, x.src_row, x) for x in out], dim=2)
                ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=q))
            if into:
                buf = kv.new_empty(B, two_hk, sum(x.length for x in into), d)
                ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=q))
                received.append((into, buf))
        gathered = _Gathered(self.bounds[p], segs, received)
        return gathered, Pending(dist.batch_isend_irecv(ops) if ops else [])

    def scatter(
        self, grads: list[torch.Tensor], acc: torch.dtype, group
    ) -> tuple[torch.Tensor, Pending]:
        """Dual of ``gather``: each segment's ``dkv [B, 2hk, L, d]`` -> this rank's ``[B, 2hk,
        T, d]`` in ``acc``, every position summed over the ranks that received it. The sum is
        complete once the handle has been waited for."""
        p, D = dist.get_rank(group), self.layout.size
        B, two_hk, _, d = grads[0].shape
        out = grads[0].new_zeros(B, two_hk, self.layout.local_len, d, dtype=acc)
        for x in self._between(p, p):
            _rows(out, x.src_row, x).add_(_rows(grads[x.segment], x.dst_row, x))
        ops, received = [], []
        for q in range(D):
            if q == p:
                continue
            back, home = self._between(q, p), self._between(p, q)
            if back:
                parts = [_rows(grads[x.segment], x.dst_row, x) for x in back]
                buf = torch.cat(parts, dim=2).to(acc)
                ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=q))
            if home:
                buf = out.new_empty(B, two_hk, sum(x.length for x in home), d)
                ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=q))
                received.append((home, buf))
        return out, _AddAfter(dist.batch_isend_irecv(ops) if ops else [], received, out)


def _rows(t: torch.Tensor, row: int, x: Piece) -> torch.Tensor:
    """Rows ``[row, row + x.length)`` of ``t [B, 2hk, L, d]``."""
    return t[:, :, row : row + x.length]


class _Gathered:
    """Segments being filled: the local pieces are in, the received ones land on ``fill``."""

    def __init__(self, bounds, segs, received) -> None:
        self.bounds, self.segs, self.received = bounds, segs, received

    def segments(self) -> list[tuple[int, torch.Tensor]]:
        """``(base, kv [B, 2hk, L, d])`` per segment, the exchange's handle waited for."""
        for pieces, buf in self.received:
            row = 0
            for x in pieces:
                seg = self.segs[x.segment]
                seg[:, :, x.dst_row : x.dst_row + x.length] = buf[:, :, row : row + x.length]
                row += x.length
        self.received = []
        return [(b, s) for (b, _), s in zip(self.bounds, self.segs)]


class _AddAfter(Pending):
    """Handle of ``scatter``: adds the received gradient pieces into ``out`` once they arrived."""

    def __init__(self, works, received, out: torch.Tensor) -> None:
        super().__init__(works)
        self._received, self._out = received, out

    def wait(self) -> None:
        super().wait()
        for pieces, buf in self._received:
            row = 0
            for x in pieces:
                _rows(self._out, x.src_row, x).add_(buf[:, :, row : row + x.length])
                row += x.length
        self._received = []
