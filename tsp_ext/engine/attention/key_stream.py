"""A head bucket's attention with its K/V streamed one zigzag chunk at a time (``head_bucket``;
one causal stream or packed documents, no sliding window, the kernels' GQA map).

Chunk j holds positions ``[j·c, (j+1)·c)``: rank j's first chunk or rank 2D-1-j's second. In
token order, the chunk's owner broadcasts its K/V; every rank attends its local queries to the
pieces of their keys that lie in it (``kernels.chunked._blocks`` with ``key_block``, cut at the
chunk) and merges the partial outputs in place (``lse.merge_into``). In backward every rank
adds its queries' gradients of the chunk's keys into one chunk-sized buffer, summed into the
owner's rows (``comm.reduce``). No rank holds a bucket's K/V or dK/dV of all S tokens, only one
chunk's (two with ``overlap``: the next chunk's broadcast in flight), for the traffic of the
all-gather and reduce-scatter they replace.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ..kernels.chunked import _backward, _blocks, _forward
from ..kernels.lse import merge_into, stats_dtype
from ..parallel import comm
from ..sharding.layout import RowSpans, Span, ZigzagLayout, chunk_owner
from .head_groups import AttentionCall
from .qkv import split_kv


def _owner(layout: ZigzagLayout, j: int) -> tuple[int, int]:
    """``(rank, local row)`` where chunk ``j`` starts."""
    rank, slot = chunk_owner(j, layout.size)
    return rank, slot * layout.chunk


def _stream(kv: Tensor, layout: ZigzagLayout, group, ahead: bool) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(j, kv_j [B, 2hk, c, d])`` for every chunk j in token order, broadcast by its
    owner from ``kv [B, 2hk, T, d]`` (``ahead``: chunk j+1's broadcast posted before chunk j is
    yielded)."""
    _, p = comm.size_and_rank(group)
    c, n = layout.chunk, 2 * layout.size

    def post(j: int):
        q, row = _owner(layout, j)
        if q == p:
            buf = kv[:, :, row : row + c].contiguous()
        else:
            buf = kv.new_empty(kv.shape[0], kv.shape[1], c, kv.shape[3])
        return buf, comm.broadcast(buf, q, group, async_op=True)

    nxt = post(0)
    for j in range(n):
        cur, nxt = nxt, None
        if ahead and j + 1 < n:
            nxt = post(j + 1)
        buf, handle = cur
        handle.wait()
        del cur
        yield j, buf
        del buf
        if not ahead and j + 1 < n:
            nxt = post(j + 1)


def _rows(q_spans: Sequence[Span] | RowSpans, B: int) -> list[tuple[slice, Sequence[Span]]]:
    """``(batch rows, their spans)``: all rows at once, or (packed documents) row by row."""
    if isinstance(q_spans, RowSpans):
        return [(slice(b, b + 1), spans) for b, spans in enumerate(q_spans.rows)]
    return [(slice(0, B), q_spans)]


def _chunk_pieces(spans: Sequence[Span], j: int, c: int) -> list[tuple[slice, slice, str]]:
    """The key pieces of ``spans`` that lie in chunk ``j``: ``(query rows, keys relative to the
    chunk, mask)``. A span lies in one chunk, so its causal diagonal is never cut."""
    lo_j, hi_j = j * c, (j + 1) * c
    out = []
    for s in spans:
        for _, pieces in _blocks(s, False, None, key_block=True) if s.length else ():
            for r, keys, mask in pieces:
                lo, hi = max(keys.start, lo_j), min(keys.stop, hi_j)
                if lo < hi:
                    rows = slice(s.offset + r.start, s.offset + r.stop)
                    out.append((rows, slice(lo - lo_j, hi - lo_j), mask))
    return out


def streamed_forward(call: AttentionCall, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention of the local queries ``q [B, T, Hq, d]`` (at ``call.q_spans``) to all S
    keys, whose K/V ``kv [B, 2hk, T, d]`` (this rank's tokens, K's heads then V's) stream past
    chunk by chunk (with ``overlap``, the next chunk's broadcast posted ahead). Returns out
    ``[B, T, Hq, d]`` (q's dtype) and lse ``[B, Hq, T]`` (``stats_dtype``), as
    ``chunked_attention_forward`` over the gathered keys."""
    layout, attn = call.layout, call.chunked
    B, T, hq, _ = q.shape
    cdt = stats_dtype(q)
    acc = torch.zeros_like(q, dtype=cdt)  # the merged partial outputs
    lse = torch.full((B, hq, T), float("-inf"), dtype=cdt, device=q.device)
    for j, kv_j in _stream(kv, layout, call.group, call.options.overlap):
        k, v = split_kv(kv_j)
        for b, spans in _rows(call.q_spans, B):
            for rows, keys, mask in _chunk_pieces(spans, j, layout.chunk):
                o, l = _forward(attn, q[b, rows], (k[b, keys], v[b, keys]), mask)
                merge_into(acc[b, rows], lse[b, :, rows], o, l)
                del o, l  # before the next piece's are made
    return acc.to(q.dtype), lse


def streamed_backward(
    call: AttentionCall, dout: Tensor, q: Tensor, kv: Tensor, fwd: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """Gradients of ``streamed_forward`` given its ``fwd = (out, lse)`` and ``dout`` (like out):
    dq ``[B, T, Hq, d]`` (q's dtype) and this rank's dK/dV rows ``[B, 2hk, T, d]`` in
    ``call.acc``, summed over every rank's queries (each chunk's reduced into its owner as soon
    as its pieces are done)."""
    layout, attn, group, (out, lse) = call.layout, call.chunked, call.group, fwd
    B = q.shape[0]
    _, p = comm.size_and_rank(group)
    c = layout.chunk
    dq = torch.zeros_like(q, dtype=stats_dtype(q))
    dkv = torch.zeros(kv.shape, dtype=call.acc, device=kv.device)
    for j, kv_j in _stream(kv, layout, group, call.options.overlap):
        k, v = split_kv(kv_j)
        g = torch.zeros(kv_j.shape, dtype=call.acc, device=kv_j.device)  # the chunk's dK, dV
        dk, dv = split_kv(g)
        for b, spans in _rows(call.q_spans, B):
            for rows, keys, mask in _chunk_pieces(spans, j, c):
                o, l = out[b, rows], lse[b, :, rows].contiguous()
                kv_c = (k[b, keys], v[b, keys])
                g_q, g_k, g_v = _backward(
                    attn, dout[b, rows], q[b, rows], kv_c, fwd=(o, l), mask=mask
                )
                dq[b, rows] += g_q
                dk[b, keys] += g_k
                dv[b, keys] += g_v
                del g_q, g_k, g_v  # before the next piece's are made
        owner, row = _owner(layout, j)
        comm.reduce(g, owner, group).wait()
        if owner == p:
            dkv[:, :, row : row + c] = g
        del g, dk, dv
    return dq.to(q.dtype), dkv
