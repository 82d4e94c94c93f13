"""Causal attention of local queries to gathered keys, blockwise, by global position.

Flash-attention style in plain PyTorch: the scores of one (query block, key block) pair are the
only transient of size queries x keys; no S x S (or T x S) mask or score matrix ever exists. A
block pair is skipped when every key is later than every query, computed without a mask when
every key is earlier, and masked (a small boolean block) only on the diagonal. GQA is handled by
folding the query heads that share a KV head into the rows of one matmul, so K/V are never
expanded. The forward returns the log-sum-exp per query; the backward recomputes probabilities
from it (exact: the same arithmetic as the forward, no approximation).

Shapes: q ``[B, T, Hq, d]``; each key span ``k, v [B, L, Hk, d]``; Hq = g * Hk, query head i uses
KV head i // g (Hugging Face order). Softmax statistics are kept in float32 (float64 for float64
inputs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..sharding.layout import Span
from .lse import stats_dtype

KVSpan = tuple[Span, torch.Tensor, torch.Tensor]  # (positions, k [B, L, Hk, d], v [B, L, Hk, d])


def _blocks(span: Span, size: int) -> Iterator[Span]:
    for i in range(0, span.length, size):
        yield Span(span.offset + i, span.start + i, min(size, span.length - i))


def _fold(x: torch.Tensor, hk: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, t, Hq, d]`` -> ``[B, Hk, g*t, d]``: query heads sharing a KV head become rows."""
    B, t, hq, d = x.shape
    return x.to(dtype).view(B, t, hk, hq // hk, d).permute(0, 2, 3, 1, 4).reshape(B, hk, -1, d)


def _unfold(x: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of ``_fold``: ``[B, Hk, g*t, d]`` -> ``[B, t, Hq, d]``."""
    B, hk, _, d = x.shape
    return x.view(B, hk, -1, t, d).permute(0, 3, 1, 2, 4).reshape(B, t, -1, d)


def _kv_blocks(qb: Span, span: Span, kv: tuple[torch.Tensor, torch.Tensor], size: int):
    """Blocks of one key span (its ``kv = (k, v)``) that query block ``qb`` can see.

    Yields ``(sl, k, v, mask)``: ``sl`` slices the span's tokens, ``k, v [B, Hk, L, d]``, and
    ``mask [tq, L]`` (bool, True = visible) or None when every key is visible.
    """
    k, v = kv
    q_last = qb.stop - 1
    for i in range(0, span.length, size):
        start, stop = span.start + i, span.start + min(i + size, span.length)
        if start > q_last:
            break  # this and later blocks of the span are all in the future
        mask = None
        if stop - 1 > qb.start:  # straddles the diagonal: keep key <= query
            qpos = torch.arange(qb.start, qb.stop, device=k.device)
            kpos = torch.arange(start, stop, device=k.device)
            mask = kpos[None, :] <= qpos[:, None]
        sl = slice(i, i + stop - start)
        yield sl, k[:, sl].transpose(1, 2), v[:, sl].transpose(1, 2), mask


def _scores(qf: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, tq: int) -> torch.Tensor:
    """``qf [B, Hk, g*tq, d]`` (pre-scaled) x ``k [B, Hk, L, d]`` -> ``[B, Hk, g*tq, L]``."""
    s = qf @ k.to(qf.dtype).transpose(-1, -2)
    if mask is not None:
        B, hk, rows, L = s.shape
        s = s.view(B, hk, rows // tq, tq, L).masked_fill(~mask, float("-inf")).view(B, hk, rows, L)
    return s


def attention_forward(
    q: torch.Tensor,
    q_spans: Sequence[Span],
    kv: Sequence[KVSpan],
    scale: float,
    block: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention output ``[B, T, Hq, d]`` (q's dtype) and log-sum-exp ``[B, Hq, T]``."""
    B, T, hq, _ = q.shape
    hk = kv[0][1].shape[2]
    cdt = stats_dtype(q)
    out = torch.empty_like(q)
    lse = torch.empty(B, hq, T, dtype=cdt, device=q.device)
    for qspan in q_spans:
        for qb in _blocks(qspan, block):
            rows = slice(qb.offset, qb.offset + qb.length)
            qf = _fold(q[:, rows], hk, cdt) * scale
            m = torch.full(qf.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros_like(qf)
            for span, k_span, v_span in kv:
                for _, k, v, mask in _kv_blocks(qb, span, (k_span, v_span), block):
                    s = _scores(qf, k, mask, qb.length)
                    m_new = torch.maximum(m, s.amax(-1))
                    m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with no key yet
                    p = torch.exp(s - m_use[..., None])
                    alpha = torch.exp(m - m_use)
                    l = l * alpha + p.sum(-1)
                    acc = acc * alpha[..., None] + p @ v.to(cdt)
                    m = m_new
            out[:, rows] = _unfold(acc / l[..., None], qb.length).to(q.dtype)
            lse[:, :, rows] = (m + torch.log(l)).view(B, hk, -1, qb.length).reshape(B, hq, -1)
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    q_spans: Sequence[Span],
    kv: Sequence[KVSpan],
    dkv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    fwd: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    block: int = 512,
) -> torch.Tensor:
    """Gradients of ``attention_forward`` given its ``fwd = (out, lse)``: returns dq ``[B, T,
    Hq, d]`` and *adds* dK/dV into ``dkv`` (one ``(dk, dv)`` pair of ``[B, L, Hk, d]`` buffers
    per key span, float32/64)."""
    out, lse = fwd
    B = q.shape[0]
    hk = kv[0][1].shape[2]
    cdt = stats_dtype(q)
    dq = torch.empty_like(q)
    for qspan in q_spans:
        for qb in _blocks(qspan, block):
            rows = slice(qb.offset, qb.offset + qb.length)
            qf = _fold(q[:, rows], hk, cdt) * scale
            do = _fold(dout[:, rows], hk, cdt)
            lse_b = lse[:, :, rows].reshape(B, hk, -1)  # rows ordered as in _fold
            delta = (do * _fold(out[:, rows], hk, cdt)).sum(-1)
            dqf = torch.zeros_like(qf)
            for (span, k_span, v_span), (dk_span, dv_span) in zip(kv, dkv):
                for sl, k, v, mask in _kv_blocks(qb, span, (k_span, v_span), block):
                    s = _scores(qf, k, mask, qb.length)
                    p = torch.exp(s - lse_b[..., None])
                    ds = p * (do @ v.to(cdt).transpose(-1, -2) - delta[..., None])
                    dqf += ds @ k.to(cdt)
                    dk_span[:, sl] += (ds.transpose(-1, -2) @ qf).transpose(1, 2)
                    dv_span[:, sl] += (p.transpose(-1, -2) @ do).transpose(1, 2)
            dq[:, rows] = _unfold(dqf * scale, qb.length).to(q.dtype)
    return dq
