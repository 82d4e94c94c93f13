"""Softmax statistics of attention: their dtype, the exact log-sum-exp merge of partial
attentions of the same queries over disjoint key sets, and attention sinks (gpt-oss)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def stats_dtype(t: Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs: the dtype of scores, lse and merged outputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge ``(out [..., d], lse [...])`` partials (lse laid out like out without ``d``).

    Returns out ``[..., d]`` and lse ``[...]`` in ``stats_dtype``. An empty partial may come as
    lse -inf, NaN or +inf (kernels differ): all get weight 0; a query that saw no key in any
    partial gets out 0 and lse -inf, not NaN.
    """
    cdt = stats_dtype(parts[0][0])
    lses = [_empty_as_neg_inf(lse.to(cdt)) for _, lse in parts]
    lse = functools.reduce(torch.logaddexp, lses)
    ref = lse.masked_fill(lse == _NEG_INF, 0.0)
    out = None
    for (o, _), l in zip(parts, lses):
        w = torch.exp(l - ref)[..., None]
        term = torch.where(w > 0, o.to(cdt) * w, 0.0)
        out = term if out is None else out + term
    return out, lse


def merge_into(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
    """Merge the partial ``(o [B, r, H, d], l [B, H, r])`` into the running ``(out, lse)`` of
    the same queries (laid out alike, ``stats_dtype``; lse -inf before the first partial), in
    place: no temporary of out's size. Every query of the partial must have seen a key (finite
    ``l``), as the pieces of one query span's keys do."""
    new = torch.logaddexp(lse, l.to(lse.dtype))
    out.mul_(torch.exp(lse - new).transpose(1, 2)[..., None])
    out.addcmul_(o.to(out.dtype), torch.exp(l - new).transpose(1, 2)[..., None])
    lse.copy_(new)


def _empty_as_neg_inf(lse: Tensor) -> Tensor:
    return torch.where(torch.isnan(lse) | (lse == float("inf")), _NEG_INF, lse)


def add_sink(out: Tensor, lse: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """Attention ``out [B, T, H, d]``, ``lse [B, H, T]`` of all of a row's keys with a sink per
    head ``sink [H]`` (gpt-oss: one more key of logit σ_h and value 0 in every row's softmax):
    ``out·sigmoid(lse - σ)`` in out's dtype and ``logaddexp(lse, σ)``. Applied once per row,
    after every partial is merged; a row with no key gets out 0. The plain attention backward
    fed these (out', lse') is exact for q, k, v; ``sink_grad`` gives σ's gradient."""
    s = sink.to(lse.dtype)[:, None]
    w = torch.sigmoid(lse - s).transpose(1, 2)[..., None]
    return (out.to(lse.dtype) * w).to(out.dtype), torch.logaddexp(lse, s)


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """``dσ [H]`` (in lse's dtype) of ``add_sink`` from the heads-major ``dout, out [B, H, T, d]``
    (out and lse as it returned them): ``-Σ_{b,t} exp(σ - lse')·⟨dout, out'⟩``."""
    dot = torch.einsum("bhtd,bhtd->bht", dout.to(lse.dtype), out.to(lse.dtype))
    return -(torch.exp(sink.to(lse.dtype)[:, None] - lse) * dot).sum((0, 2))
