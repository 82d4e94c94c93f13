"""Chunked causal attention of local query chunks on any kernel of ``attention_backends``.

The chunked functions take K/V in natural token order (position i at index i). A local query
chunk at global positions ``[s, s+C)`` attends keys ``[0, s+C)`` causally. Where a kernel's
``is_causal`` aligns a short query block with the *end* of its keys (bottom-right: query i of Lq
sees keys <= i + Lk - Lq; ``one_call_causal``), that is one call. Otherwise (top-left kernels:
query i sees keys <= i) it is two, merged by log-sum-exp: the prefix keys ``[0, s)`` with no mask
and the square diagonal block ``[s, s+C)`` with ``is_causal=True``, where both alignments agree.
The transients are one chunk's outputs and gradients; nothing of size T x S exists. In a packed
row (``engine.documents``) chunks are cut where documents start and a span's keys begin at its
document's first key (``Span.first_key``): no call ever touches another document's keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .attention_backends import AttentionKernel
from .layout import RowSpans, Span
from .lse import merge_partials, stats_dtype


def _check(q: Tensor, q_spans: Sequence[Span], k: Tensor, v: Tensor) -> None:
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


def _pieces(s: Span, one_call: bool) -> list[tuple[slice, bool]]:
    """Key ranges of a query span and whether each is causal: all of ``[first_key, stop)`` if
    ``one_call`` (a bottom-right kernel), else the diagonal, then the prefix ``[first_key, start)``
    if not empty."""
    if one_call:
        return [(slice(s.first_key, s.stop), True)]
    prefix = [(slice(s.first_key, s.start), False)] if s.start > s.first_key else []
    return [(slice(s.start, s.stop), True)] + prefix


def _per_row(fn, q_spans: RowSpans, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``fn(row_spans, *row_tensors)`` for every batch row, results concatenated along dim 0."""
    if len(q_spans.rows) != tensors[0].shape[0]:
        raise ValueError(f"{len(q_spans.rows)} rows of spans for a batch of {tensors[0].shape[0]}")
    outs = [fn(s, *(t[b : b + 1] for t in tensors)) for b, s in enumerate(q_spans.rows)]
    return tuple(torch.cat(parts) for parts in zip(*outs))


def chunked_attention_forward(
    kernel: AttentionKernel,
    q: Tensor,
    q_spans: Sequence[Span] | RowSpans,
    k: Tensor,
    v: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Causal attention of local query chunks to keys in natural order.

    Args:
        q: ``[B, T, Hq, d]``; ``q_spans`` cover its rows: ``Span(offset, start, length,
            first_key)`` = rows ``[offset, offset+length)`` hold global positions ``[start,
            start+length)`` and see keys from ``first_key`` on. ``RowSpans``: per batch row.
        k, v: ``[B, S, Hk, d]``, key i at position i. A query sees keys at positions <= its own.
    Returns:
        out ``[B, T, Hq, d]`` (q's dtype), lse ``[B, Hq, T]`` (float32; float64 for float64).
    """
    if isinstance(q_spans, RowSpans):

        def fwd(spans, q, k, v):
            return chunked_attention_forward(kernel, q, spans, k, v, scale)

        return _per_row(fwd, q_spans, q, k, v)
    _check(q, q_spans, k, v)
    B, T, hq, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, hq, T), float("-inf"), dtype=stats_dtype(q), device=q.device)
    one_call = kernel.one_call_causal(q.device, q.dtype)
    for s in q_spans:
        if s.length == 0:
            continue
        rows = slice(s.offset, s.offset + s.length)
        parts = [
            kernel.forward(q[:, rows], k[:, keys], v[:, keys], scale, causal)
            for keys, causal in _pieces(s, one_call)
        ]
        o, l = parts[0]
        if len(parts) > 1:  # diagonal + prefix; lse [B, H, C] laid out like o [B, C, H, d]
            o, l = merge_partials([(o_p, l_p.transpose(1, 2)) for o_p, l_p in parts])
            l = l.transpose(1, 2)
        out[:, rows] = o
        lse[:, :, rows] = l
    return out, lse


def chunked_attention_backward(
    kernel: AttentionKernel,
    dout: Tensor,
    q: Tensor,
    q_spans: Sequence[Span] | RowSpans,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``chunked_attention_forward`` given its ``out`` and ``lse``.

    Returns dq ``[B, T, Hq, d]`` in q's dtype and dk, dv ``[B, S, Hk, d]`` in float32 (float64
    for float64 inputs): every key collects terms from several query chunks, and the caller
    reduce-scatters them across ranks, so they are accumulated and returned at full precision.
    Rows of q outside every span get dq = 0. Transient: one chunk's per-piece gradients.
    """
    if isinstance(q_spans, RowSpans):

        def bwd(spans, dout, q, k, v, out, lse):
            return chunked_attention_backward(kernel, dout, q, spans, k, v, out, lse, scale)

        return _per_row(bwd, q_spans, dout, q, k, v, out, lse)
    _check(q, q_spans, k, v)
    cdt = stats_dtype(q)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k, dtype=cdt)  # k's memory layout, so the adds below are dense
    dv = torch.zeros_like(v, dtype=cdt)
    one_call = kernel.one_call_causal(q.device, q.dtype)
    for s in q_spans:
        if s.length == 0:
            continue
        rows = slice(s.offset, s.offset + s.length)
        args = (dout[:, rows], q[:, rows])
        o_c, l_c = out[:, rows], lse[:, :, rows].contiguous()
        dq_c = None
        for keys, causal in _pieces(s, one_call):
            g_q, g_k, g_v = kernel.backward(*args, k[:, keys], v[:, keys], o_c, l_c, scale, causal)
            dq_c = g_q.to(cdt) if dq_c is None else dq_c + g_q
            dk[:, keys] += g_k
            dv[:, keys] += g_v
        dq[:, rows] = dq_c
    return dq, dk, dv
