"""Gated DeltaNet's cross-rank pieces: the chunk-state exchange and composition, the conv halo.

A chunk of the gated delta rule maps its input state to ``S_out = M·S_in + C``; every rank
computes ``[C | M]`` of its two zigzag chunks in one pass, the ranks all-gather them (small:
``heads·dk·(dk+dv)`` per chunk, never O(S)) and compose them in token order. The causal conv's
left context (halo) is the last K-1 pre-conv rows of the chunks before. Both gathers are
differentiable (backward: the gradient reduce-scattered back to its owner).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ..parallel import comm
from ..sharding.layout import chunk_owner


class _Gather(torch.autograd.Function):
    """forward: ``x [...]`` -> ``[D, ...]`` rank-major. backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out, _ = comm.all_gather_seq(x, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, _ = comm.reduce_scatter_seq(grad.contiguous(), ctx.group)
        return g, None


def gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather ``[...] -> [D, ...]`` (dual: reduce-scatter to the owner)."""
    return _Gather.apply(x, group)


def exchange_states(cm: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather this rank's two chunks' transitions ``cm [2, B, H, dk, dv + dk]`` (``[C | M]``)
    -> ``[D, 2, B, H, dk, dv + dk]``."""
    return gather(cm, group)


def compose(
    gathered: torch.Tensor, dv: int, start: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Input states of the 2D chunks in token order: ``S_in(c_0) = start`` (zeros if None),
    ``S_in(c_{j+1}) = M_j S_in(c_j) + C_j``, from ``gathered [D, 2, B, H, dk, dv + dk]``.
    Returns 2D + 1 states ``[B, H, dk, dv]``, the last the final state."""
    D = gathered.shape[0]
    C0 = gathered[0, 0, ..., :dv]
    states = [torch.zeros_like(C0) if start is None else start.to(C0.dtype)]
    for j in range(2 * D):
        r, slot = chunk_owner(j, D)
        cm = gathered[r, slot]
        states.append(cm[..., dv:] @ states[-1] + cm[..., :dv])
    return states


def halo(rows: torch.Tensor, width: int, group: ProcessGroup) -> torch.Tensor:
    """Left context of this rank's two chunks: ``rows [2, B, c, C]`` (pre-conv rows of chunks p
    and 2D-1-p) -> ``[2, B, width, C]``, the ``width`` rows before each chunk in token order
    (zeros before the sequence start). Gathers only the last ``min(width, c)`` rows of every
    chunk."""
    D, p = comm.size_and_rank(group)
    m = min(width, rows.shape[2])
    tails = gather(rows[:, :, rows.shape[2] - m :], group)  # [D, 2, B, m, C]
    ordered = [tails[chunk_owner(j, D)] for j in range(2 * D)]
    pad = rows.new_zeros(rows.shape[1], width, rows.shape[3])
    out = []
    for j in (p, 2 * D - 1 - p):
        before = torch.cat([pad, *ordered[:j]], dim=1)
        out.append(before[:, before.shape[1] - width :])
    return torch.stack(out)
