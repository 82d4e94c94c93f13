"""Chunked causal attention of local query chunks on any kernel of ``backends``.

The chunked functions take K/V in natural token order (position i at index i). A local query
chunk at global positions ``[s, s+C)`` attends keys ``[0, s+C)`` causally. Where a kernel's
``is_causal`` aligns a short query block with the *end* of its keys (bottom-right: query i of Lq
sees keys <= i + Lk - Lq; ``one_call_causal``), that is one call. Otherwise (top-left kernels:
query i sees keys <= i) it is two, merged by log-sum-exp: the prefix keys ``[0, s)`` with no mask
and the square diagonal block ``[s, s+C)`` with ``is_causal=True``, where both alignments agree.
The transients are one chunk's outputs and gradients; nothing of size T x S exists. In a packed
row (``engine.sharding.documents``) chunks are cut where documents start and a span's keys begin at
its document's first key (``Span.first_key``): no call ever touches another document's keys.

Under a sliding window (query i sees keys ``(i - window, i]``) a span is cut into blocks of
window - 1 queries, each the diagonal (causal), the keys all its queries see (no mask) and the
trailing band, a causal square read backwards: the kernels never see a window or a dense mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..sharding.layout import RowSpans, Span
from .backends import AttentionKernel
from .lse import merge_partials, stats_dtype


@dataclass(frozen=True)
class ChunkedKernel:
    """How the chunked functions attend: with ``kernel``, softmax ``scale``, a sliding ``window``
    (query i sees keys ``(i - window, i]``, window >= 2; None: causal) and ``key_block`` (a
    span's earlier keys in pieces of at most its length, ``_blocks``)."""

    kernel: AttentionKernel
    scale: float
    window: int | None = None
    key_block: bool = False


def _check(q: Tensor, q_spans: Sequence[Span], kv: tuple[Tensor, Tensor], window) -> None:
    k, v = kv
    if window is not None and window < 2:
        raise ValueError(f"sliding window {window} must be >= 2 (a query and the key before it)")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[2] % k.shape[2]:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for s in q_spans:
        if (
            s.offset < 0
            or s.offset + s.length > q.shape[1]
            or not 0 <= s.first_key <= s.start
            or s.stop > k.shape[1]
        ):
            raise ValueError(f"{s} does not fit q {tuple(q.shape)} and k {tuple(k.shape)}")


_FULL, _CAUSAL, _ANTI = "full", "causal", "anti"  # mask of a piece (see ``_forward``)


def _blocks(s: Span, one_call: bool, window: int | None, key_block: bool = False):
    """A query span's blocks of rows and their pieces: ``[(block, [(rows, keys, mask)])]``;
    ``block`` and ``rows`` relative to the span's first row, ``keys`` by position, ``mask`` one
    of full / causal / anti (``_forward``). The first piece of a block covers all its rows.

    Full causal: one block; all of ``[first_key, stop)`` if ``one_call`` (a bottom-right kernel),
    else the diagonal, then the prefix ``[first_key, start)`` if not empty; with ``key_block``
    the diagonal, then the prefix in pieces of at most the span's length (no piece's key
    gradients exceed the span's). Sliding window (query i sees keys ``(i - window, i]``):
    ``_window_blocks``."""
    if window is not None:
        return _window_blocks(s, one_call, window)
    rows = slice(0, s.length)
    if one_call and not key_block:
        return [(rows, [(rows, slice(s.first_key, s.stop), _CAUSAL)])]
    size = s.length if key_block else max(s.start - s.first_key, 1)
    prefix = [
        (rows, slice(k, min(k + size, s.start)), _FULL) for k in range(s.first_key, s.start, size)
    ]
    return [(rows, [(rows, slice(s.start, s.stop), _CAUSAL)] + prefix)]


def _window_blocks(s: Span, one_call: bool, window: int):
    """Blocks ``[a, a+C)`` of C <= window - 1 queries. A block's keys are three bands: the
    diagonal ``[a, a+C)`` (causal); keys every query of the block sees, ``[a+C-window+1, a)``
    (full); the trailing band ``[a-window+1, a+C-window]``, which query i sees from
    ``i-window+1`` on: a causal square read backwards (anti). ``first_key`` cuts the trailing
    band short; the queries that then see all that is left of it take it as a full piece."""
    out = []
    f = s.first_key
    for i in range(0, s.length, window - 1):
        a, C = s.start + i, min(window - 1, s.length - i)
        rows = slice(i, i + C)
        hi = a + C - window  # the trailing band's last key
        first_seen = max(f, hi + 1)  # first key every query of the block sees
        if one_call:
            pieces = [(rows, slice(first_seen, a + C), _CAUSAL)]
        else:
            pieces = [(rows, slice(a, a + C), _CAUSAL)]
            if first_seen < a:
                pieces.append((rows, slice(first_seen, a), _FULL))
        lo = max(f, a - window + 1)
        if lo <= hi:
            L = hi - lo + 1
            if L < C:
                pieces.append((slice(i, i + C - L), slice(lo, hi + 1), _FULL))
            pieces.append((slice(i + C - L, i + C), slice(lo, hi + 1), _ANTI))
        out.append((rows, pieces))
    return out


def _flip(xs: Sequence[Tensor]) -> list[Tensor]:
    """Reverse the token order of ``[B, L, H, d]`` tensors (and of ``lse [B, H, L]``)."""
    return [x.flip(-1 if x.dim() == 3 else 1) for x in xs]


def _forward(attn: ChunkedKernel, q: Tensor, kv: tuple[Tensor, Tensor], mask: str):
    """One kernel call of ``q`` on a piece's keys ``kv = (k, v)``. ``anti``: query j of the
    square sees keys j.. (the causal square with queries and keys both reversed)."""
    kernel, scale = attn.kernel, attn.scale
    if mask != _ANTI:
        return kernel.forward(q, *kv, scale, is_causal=mask == _CAUSAL)
    out, lse = kernel.forward(*_flip((q, *kv)), scale, is_causal=True)
    return tuple(_flip((out, lse)))


def _backward(attn: ChunkedKernel, dout, q, kv: tuple[Tensor, Tensor], fwd, mask: str):
    """Gradients ``(dq, dk, dv)`` of ``_forward`` on a piece, given ``fwd = (out, lse)`` (the
    merged ones of the piece's queries)."""
    kernel, scale, (k, v), (out, lse) = attn.kernel, attn.scale, kv, fwd
    if mask != _ANTI:
        causal = mask == _CAUSAL
        return kernel.backward(dout, q, k, v, out=out, lse=lse, scale=scale, is_causal=causal)
    dout, q, k, v, out, lse = _flip((dout, q, k, v, out, lse))
    return _flip(kernel.backward(dout, q, k, v, out=out, lse=lse, scale=scale, is_causal=True))


def _spread(o: Tensor, lse: Tensor, rows: slice, n: int) -> tuple[Tensor, Tensor]:
    """A piece's ``o [B, r, H, d]``, ``lse [B, H, r]`` of ``rows`` as ``n`` rows (others empty)."""
    if rows.stop - rows.start == n:
        return o, lse
    o_n = o.new_zeros(o.shape[0], n, *o.shape[2:])
    lse_n = lse.new_full((*lse.shape[:2], n), float("-inf"))
    o_n[:, rows], lse_n[:, :, rows] = o, lse
    return o_n, lse_n


def _per_row(fn, q_spans: RowSpans, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``fn(row_spans, *row_tensors)`` for every batch row of ``tensors``, results concatenated
    along dim 0."""
    if len(q_spans.rows) != tensors[0].shape[0]:
        raise ValueError(f"{len(q_spans.rows)} rows of spans for a batch of {tensors[0].shape[0]}")
    outs = [fn(s, *(t[b : b + 1] for t in tensors)) for b, s in enumerate(q_spans.rows)]
    return tuple(torch.cat(parts) for parts in zip(*outs))


def chunked_attention_forward(
    attn: ChunkedKernel,
    q: Tensor,
    q_spans: Sequence[Span] | RowSpans,
    kv: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor]:
    """Causal attention of local query chunks to keys in natural order, as ``attn`` says
    (kernel, scale, sliding window, key blocks).

    Args:
        q: ``[B, T, Hq, d]``; ``q_spans`` cover its rows: ``Span(offset, start, length,
            first_key)`` = rows ``[offset, offset+length)`` hold global positions ``[start,
            start+length)`` and see keys from ``first_key`` on. ``RowSpans``: per batch row.
        kv: ``(k, v)``, each ``[B, S, Hk, d]``, key i at position i. A query sees keys at
            positions <= its own.
    Returns:
        out ``[B, T, Hq, d]`` (q's dtype), lse ``[B, Hq, T]`` (float32; float64 for float64).
    """
    if isinstance(q_spans, RowSpans):

        def fwd(spans, q, k, v):
            return chunked_attention_forward(attn, q, spans, (k, v))

        return _per_row(fwd, q_spans, (q, *kv))
    _check(q, q_spans, kv, attn.window)
    k, v = kv
    B, T, hq, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, hq, T), float("-inf"), dtype=stats_dtype(q), device=q.device)
    one_call = attn.kernel.one_call_causal(q.device, q.dtype)
    for s in q_spans:
        for block, pieces in _blocks(s, one_call, attn.window, attn.key_block) if s.length else ():
            n = block.stop - block.start
            o = l = None
            for r, keys, mask in pieces:  # merged as they come: one partial alive at a time
                rows = slice(s.offset + r.start, s.offset + r.stop)
                o_p, l_p = _forward(attn, q[:, rows], (k[:, keys], v[:, keys]), mask)
                o_p, l_p = _spread(o_p, l_p, slice(r.start - block.start, r.stop - block.start), n)
                if o is None:
                    o, l = o_p, l_p
                    continue
                # lse [B, H, C] laid out like o [B, C, H, d] to merge
                o, l = merge_partials([(o, l.transpose(1, 2)), (o_p, l_p.transpose(1, 2))])
                l = l.transpose(1, 2)
            rows = slice(s.offset + block.start, s.offset + block.stop)
            out[:, rows] = o
            lse[:, :, rows] = l
    return out, lse


def chunked_attention_backward(
    attn: ChunkedKernel,
    dout: Tensor,
    q: Tensor,
    q_spans: Sequence[Span] | RowSpans,
    kv: tuple[Tensor, Tensor],
    fwd: tuple[Tensor, Tensor],
    into=None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of ``chunked_attention_forward`` given its ``fwd = (out, lse)``.

    Returns dq ``[B, T, Hq, d]`` in q's dtype and dk, dv ``[B, S, Hk, d]`` in float32 (float64
    for float64 inputs): every key collects terms from several query chunks, and the caller
    reduce-scatters them across ranks, so they are accumulated and returned at full precision.
    ``into`` (``kv_exchange.RankMajorGrads``): dk and dv are added there instead (returned as
    None). Rows of q outside every span get dq = 0. Transient: one chunk's per-piece gradients.
    """
    (k, v), (out, lse) = kv, fwd
    if isinstance(q_spans, RowSpans):
        if into is not None:  # each batch row's into its rows of the accumulator
            dq = []
            for b, spans in enumerate(q_spans.rows):
                do, q_b, k_b, v_b, o, l = (t[b : b + 1] for t in (dout, q, k, v, out, lse))
                g_q, _, _ = chunked_attention_backward(
                    attn, do, q_b, spans, kv=(k_b, v_b), fwd=(o, l), into=into.rows(b)
                )
                dq.append(g_q)
            return torch.cat(dq), None, None

        def bwd(spans, dout, q, k, v, out, lse):
            return chunked_attention_backward(attn, dout, q, spans, kv=(k, v), fwd=(out, lse))

        return _per_row(bwd, q_spans, (dout, q, k, v, out, lse))
    _check(q, q_spans, kv, attn.window)
    cdt = stats_dtype(q)
    dq = torch.zeros_like(q)
    dk = dv = None
    if into is None:
        dk = torch.zeros_like(k, dtype=cdt)  # k's memory layout, so the adds below are dense
        dv = torch.zeros_like(v, dtype=cdt)
    one_call = attn.kernel.one_call_causal(q.device, q.dtype)
    for s in q_spans:
        for block, pieces in _blocks(s, one_call, attn.window, attn.key_block) if s.length else ():
            dq_b = None
            for r, keys, mask in pieces:
                rows = slice(s.offset + r.start, s.offset + r.stop)
                o_c, l_c = out[:, rows], lse[:, :, rows].contiguous()
                kv_c = (k[:, keys], v[:, keys])
                g_q, g_k, g_v = _backward(
                    attn, dout[:, rows], q[:, rows], kv_c, fwd=(o_c, l_c), mask=mask
                )
                if dq_b is None:  # the first piece covers the block
                    dq_b = g_q.to(cdt)
                else:
                    dq_b[:, r.start - block.start : r.stop - block.start] += g_q
                if into is None:
                    dk[:, keys] += g_k
                    dv[:, keys] += g_v
                else:
                    into.add(False, keys, g_k)
                    into.add(True, keys, g_v)
                del g_q, g_k, g_v  # before the next piece's are made
            dq[:, s.offset + block.start : s.offset + block.stop] = dq_b
    return dq, dk, dv


def _in_segment(q_spans, base: int, stop: int):
    """The query spans whose keys lie in the segment ``[base, stop)``, in its coordinates."""

    def shift(spans):
        return tuple(
            Span(s.offset, s.start - base, s.length, max(s.first_key - base, 0))
            for s in spans
            if base <= s.start and s.stop <= stop
        )

    if isinstance(q_spans, RowSpans):
        return RowSpans(tuple(shift(row) for row in q_spans.rows))
    return shift(q_spans)


def segments_forward(attn: ChunkedKernel, q: Tensor, q_spans, segments):
    """``chunked_attention_forward`` of ``q [B, T, Hq, d]`` over K/V ``segments`` ``(base, K,
    V)``; a query's keys are all in one segment (rows of other segments' spans stay 0, -inf)."""
    out = lse = None
    for base, k, v in segments:
        spans = _in_segment(q_spans, base, base + k.shape[1])
        o, l = chunked_attention_forward(attn, q, spans, (k, v))
        out, lse = (o, l) if out is None else (out.add_(o), torch.maximum(lse, l))
    return out, lse


def segments_backward(attn: ChunkedKernel, da, q, q_spans, segments, fwd, into=None):
    """Gradients of ``segments_forward`` given its ``fwd = (a, lse)``: dq and ``[(dK, dV)]`` per
    segment (``into``: of the one segment of all S keys, added there; ``[(None, None)]``)."""
    dq, grads = None, []
    for base, k, v in segments:
        spans = _in_segment(q_spans, base, base + k.shape[1])
        g_q, g_k, g_v = chunked_attention_backward(
            attn, da, q, spans, kv=(k, v), fwd=fwd, into=into
        )
        dq = g_q if dq is None else dq.add_(g_q)
        grads.append((g_k, g_v))
    return dq, grads
