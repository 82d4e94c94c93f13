"""Softmax statistics of attention: their dtype, and the exact log-sum-exp merge of partial
attentions of the same queries over disjoint key sets."""

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


def _empty_as_neg_inf(lse: Tensor) -> Tensor:
    return torch.where(torch.isnan(lse) | (lse == float("inf")), _NEG_INF, lse)
