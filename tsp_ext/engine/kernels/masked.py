"""Exact attention under an explicit key mask, returning the log-sum-exp (``lse.merge_partials``
merges such partials over disjoint key sets).

Inference uses it where the fused causal kernels do not fit: prompts with left padding (some
keys hidden from every query) and decode steps against a KV cache whose tokens are not in one
contiguous causal block (a replica's share of a KV head when D > n_kv_heads).

Scores are computed in float32 (float64 for float64 inputs) for one query span at a time:
``[B, n_kv, g, Tq, L]`` for ``Tq`` queries against ``L`` keys (g = query heads per KV head).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sharding.layout import Span
from .lse import stats_dtype

_NEG_INF = float("-inf")


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [B, Tq, Hq, d]`` to ``k, v [B, L, Hk, d]`` (GQA: query head i
    uses KV head i // (Hq/Hk)) where ``allowed [B, Tq, L]`` (bool) says which keys each query sees.

    Returns ``out [B, Tq, Hq, d]`` and ``lse [B, Hq, Tq]`` in ``stats_dtype``; a query that
    sees no key (or L = 0) gets out 0 and lse -inf, so merging it with other partials is exact.
    """
    B, Tq, Hq, d = q.shape
    Hk = k.shape[2]
    cdt = stats_dtype(q)
    qf = q.to(cdt).view(B, Tq, Hk, Hq // Hk, d).permute(0, 2, 3, 1, 4)  # [B, Hk, g, Tq, d]
    kf, vf = k.to(cdt).transpose(1, 2), v.to(cdt).transpose(1, 2)  # [B, Hk, L, d]
    s = torch.einsum("bhgtd,bhld->bhgtl", qf, kf).mul_(scale)
    s.masked_fill_(~allowed[:, None, None], _NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hk, g, Tq]
    ref = lse.masked_fill(lse == _NEG_INF, 0.0)
    probs = torch.exp(s.sub_(ref[..., None]))  # exp(-inf) = 0 for hidden keys
    out = torch.einsum("bhgtl,bhld->bhgtd", probs, vf)  # [B, Hk, g, Tq, d]
    return out.permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, d), lse.reshape(B, Hq, Tq)


def masked_chunked_attention(
    q: torch.Tensor,
    q_spans: Sequence[Span],
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of local query chunks to keys in natural order, hiding padded keys.

    Args:
        q: ``[B, T, Hq, d]`` whose rows ``q_spans`` hold global positions (as in
            ``chunked_attention_forward``).
        k, v: ``[B, S, Hk, d]``, key i at position i.
        key_valid: ``[B, S]`` bool, False for padding. A query sees the valid keys at positions
            <= its own, and always itself (a padded query then stays finite; no real query
            ever sees it).
        window: sliding window (a query sees keys ``(i - window, i]``) or None.
    Returns:
        out ``[B, T, Hq, d]`` (q's dtype) and lse ``[B, Hq, T]`` (``stats_dtype``).
    """
    B, T, Hq, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, Hq, T), _NEG_INF, dtype=stats_dtype(q), device=q.device)
    for s in q_spans:
        if s.length == 0:
            continue
        q_pos = torch.arange(s.start, s.stop, device=q.device)[:, None]  # [C, 1]
        k_pos = torch.arange(s.stop, device=q.device)[None]  # [1, stop]
        allowed = (k_pos <= q_pos) & (key_valid[:, None, : s.stop] | (k_pos == q_pos))
        if window is not None:
            allowed &= k_pos > q_pos - window
        rows = slice(s.offset, s.offset + s.length)
        o, l = partial_attention(q[:, rows], k[:, : s.stop], v[:, : s.stop], allowed, scale=scale)
        out[:, rows], lse[:, :, rows] = o.to(q.dtype), l
    return out, lse
