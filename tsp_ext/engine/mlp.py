"""TSP gated MLP (SwiGLU): weight shards travel a ring while each rank keeps its tokens.

Rank p holds slice p of the intermediate dimension (rows of gate/up, columns of down; ``⌊F/D⌋``
or ``⌈F/D⌉`` of them, the first ``F mod D`` ranks one more) and the tokens of zigzag shard p. The
ring carries buffers sized to the largest shard; each step unpacks its owner's real shapes.
Forward:

    cur = (G_p, U_p, Dn_p); Y_p = 0
    for t in 0..D-1:                       # cur is the shard of owner p - t
        if t < D-1: send cur -> p+1, recv next <- p-1      # async, overlaps the matmuls
        Y_p += (silu(X_p·Gᵀ) ⊙ (X_p·Uᵀ))·Dnᵀ
        wait; cur = next

Backward runs the same weight ring plus a second ring of gradient accumulators one step behind:
at step t >= 1 rank p adds its tokens' contribution to shard p - t's accumulator and passes it
on, so after the last hop every accumulator lands at its owner with all D contributions (the
owner adds its own, computed at t = 0). dX_p accumulates locally. Saved per rank: X_p and the
rank's own shards; the intermediate activations are recomputed shard by shard in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import TSPConfig
from . import comm
from .weight_ring import GradientRing, circulate


def _swiglu_backward(x, dy, g, u, dn, acc: torch.dtype, hidden=None):
    """Gradients of one shard's ``(silu(X·Gᵀ) ⊙ (X·Uᵀ))·Dnᵀ``: ``(dX, dG, dU, dDn)``, the weight
    gradients in ``acc``.

    ``hidden``: the saved gate/up pre-activations ``[2, B, T, F/D]``; recomputed if None.
    """
    hg, hu = hidden if hidden is not None else (F.linear(x, g), F.linear(x, u))  # [B, T, F/D]
    act = F.silu(hg)
    dm = dy @ dn  # [B, T, F/D]
    dhu = dm * act
    dhg = torch.ops.aten.silu_backward(dm.mul_(hu), hg)  # one fused kernel for silu'
    x2, dy2 = x.flatten(0, 1).to(acc), dy.flatten(0, 1).to(acc)
    d_dn = dy2.t() @ act.mul_(hu).flatten(0, 1).to(acc)
    d_g = dhg.flatten(0, 1).to(acc).t() @ x2
    d_u = dhu.flatten(0, 1).to(acc).t() @ x2
    dx = torch.addmm(dhg.flatten(0, 1) @ g, dhu.flatten(0, 1), u).view_as(x)
    return dx, d_g, d_u, d_dn


class _RingSchedule:
    """Weight ring of one call: every owner's shard shapes, group, options."""

    def __init__(self, group, config: TSPConfig, x: torch.Tensor, weights, sizes) -> None:
        self.group, self.config = group, config
        self.ring = comm.Ring(group)
        self.D, self.p = self.ring.size, self.ring.rank
        h = x.shape[-1]
        sizes = sizes or [weights[0].shape[0]] * self.D
        # (G, U, Dn) shapes of owner q's slice of f_q rows: [f_q, h], [f_q, h], [h, f_q]
        self.shapes = [[torch.Size((f, h))] * 2 + [torch.Size((h, f))] for f in sizes]
        self.numel = 3 * h * max(sizes)
        self.acc = config.accum_for(x.dtype)

    def shards(self, weights):
        """Yield ``(t, (G, U, Dn))`` of owner p - t; the next one arrives while the caller works."""
        packed = comm.pack(weights, numel=self.numel)  # a copy: it may serve as a receive buffer
        for t, cur in circulate(self.ring, packed, self.config.overlap, reuse=True):
            yield t, comm.unpack(cur, self.shapes[(self.p - t) % self.D])


def tsp_mlp_forward(sched: _RingSchedule, x: torch.Tensor, weights, keep_hidden: bool = False):
    """Forward ring: ``X_p [B, T, h]`` -> ``Y_p [B, T, h]``, plus, if ``keep_hidden``, every
    step's gate/up pre-activations, a list of D ``[2, B, T, f_q]`` (else None)."""
    y = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    hidden = [] if keep_hidden else None
    for _, (g, u, dn) in sched.shards(weights):
        hg, hu = F.linear(x, g), F.linear(x, u)
        if keep_hidden:
            hidden.append(torch.stack([hg, hu]))
        y += F.linear(F.silu(hg) * hu, dn)
    return y.to(x.dtype), hidden


def tsp_mlp_backward(sched: _RingSchedule, dy: torch.Tensor, x: torch.Tensor, weights, hidden=None):
    """Backward rings: returns ``dX_p`` and the fully reduced gradients of this rank's shards.
    ``hidden``: what ``tsp_mlp_forward(keep_hidden=True)`` returned, or None to recompute."""
    dy = dy.contiguous()
    dx = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    owner_grads = GradientRing(sched.ring)
    for t, (g, u, dn) in sched.shards(weights):
        h_t = hidden[t] if hidden is not None else None
        dx_t, *dw = _swiglu_backward(x, dy, g, u, dn, sched.acc, h_t)
        dx += dx_t
        owner_grads.add(t, comm.pack(dw, sched.acc, sched.numel))
    grads = comm.unpack(owner_grads.result(), sched.shapes[sched.p])
    return dx.to(x.dtype), [gr.to(w.dtype) for gr, w in zip(grads, weights)]


class _TSPMLPFunction(torch.autograd.Function):
    """Autograd boundary of the ring schedule: saves X_p and the rank's own shards (plus every
    step's gate/up pre-activations, D x ``[2, B, S/D, f_q]``, when ``config.recompute_mlp`` is
    off)."""

    @staticmethod
    def forward(ctx, group, config, sizes, x, g, u, dn):
        sched = _RingSchedule(group, config, x, (g, u, dn), sizes)
        keep = not config.recompute_mlp and any(ctx.needs_input_grad)
        y, hidden = tsp_mlp_forward(sched, x, (g, u, dn), keep_hidden=keep)
        ctx.sched, ctx.n_hidden = sched, len(hidden or ())
        ctx.save_for_backward(x, g, u, dn, *(hidden or ()))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors[:4]
        hidden = ctx.saved_tensors[4:] if ctx.n_hidden else None
        dx, (d_g, d_u, d_dn) = tsp_mlp_backward(ctx.sched, dy, x, weights, hidden)
        return None, None, None, dx, d_g, d_u, d_dn


def tsp_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    group,
    config: TSPConfig,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """Ring SwiGLU of this rank's tokens: ``x [B, S/D, h]`` -> ``[B, S/D, h]`` with this rank's
    slices ``gate, up [f_p, h]`` and ``down [h, f_p]``; ``sizes [D]``: every rank's ``f_q``
    (``partition.split_sizes(F, D)``; None: all equal to this rank's)."""
    return _TSPMLPFunction.apply(group, config, sizes, x, gate, up, down)
