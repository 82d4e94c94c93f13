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

from . import comm
from .options import EngineOptions
from .pointwise import add_matmul, matmul
from .weight_ring import GradientRing, circulate


def swiglu_pointwise_backward(dm: torch.Tensor, hid: torch.Tensor, s=None, act=None):
    """The elementwise part of the SwiGLU backward, in place: from ``dM = dY·Dn`` ``[B, T, f]``
    and the gate/up pre-activations ``hid = [hg | hu]`` ``[B, T, 2f]`` (both overwritten),
    returns ``hid`` holding their gradients ``[dhg | dhu]`` (one buffer, so that both weight
    gradients are one GEMM) and the forward's activation ``silu(hg) ⊙ hu`` ``[B, T, f]``, the
    input of Dn. ``s``, ``act``: ``[B, T, f]`` buffers to use (fresh ones if None)."""
    hg, hu = hid.chunk(2, dim=-1)
    s = F.silu(hg) if s is None else torch.ops.aten.silu.out(hg, out=s)
    act = torch.mul(s, hu) if act is None else torch.mul(s, hu, out=act)
    s.mul_(dm)  # dhu
    torch.ops.aten.silu_backward.grad_input(dm.mul_(hu), hg, grad_input=hg)  # dhg, over hg
    hu.copy_(s)
    return hid, act


class _Workspace:
    """Flat buffers reused by every step of one ring pass (sized for the largest shard): on CPU
    a fresh ``[B, T, 2f]`` tensor per step is a fresh mapping whose first touch page-faults."""

    def __init__(self, x: torch.Tensor, f_max: int) -> None:
        self.x, self.f_max, self.buffers = x, f_max, {}

    def get(self, name: str, f: int, per_f: int = 1) -> torch.Tensor:
        """Buffer ``name`` as ``[*x.shape[:-1], per_f · f]`` for a shard of width ``f`` (its
        capacity: ``per_f · f_max`` columns)."""
        rows = self.x.shape[:-1]
        if name not in self.buffers:
            self.buffers[name] = self.x.new_empty(rows.numel() * per_f * self.f_max)
        return self.buffers[name][: rows.numel() * per_f * f].view(*rows, per_f * f)


def _pre_activations(x: torch.Tensor, gu: torch.Tensor, work: _Workspace) -> torch.Tensor:
    """``[X·Gᵀ | X·Uᵀ]`` ``[B, T, 2f]`` of ``gu = [G; U]``, one GEMM into the workspace."""
    hid = work.get("hid", gu.shape[0] // 2, 2)
    torch.mm(x.reshape(-1, x.shape[-1]), gu.t(), out=hid.view(-1, gu.shape[0]))
    return hid


def _swiglu_weight_grads(x, dy, gu, dn, out, work: _Workspace, hidden=None) -> torch.Tensor:
    """Backward of one shard's ``(silu(X·Gᵀ) ⊙ (X·Uᵀ))·Dnᵀ`` with ``gu = [G; U]`` (``[2f, h]``):
    writes ``[dG; dU]`` (``[2f, h]``) and ``dDn`` (``[h, f]``) into ``out``, a flat buffer in the
    accumulation dtype laid out like the shard, and returns ``dH [B·T, 2f]`` (in ``work``, valid
    until the next shard), the gradient of the gate/up pre-activations: the caller adds
    ``dX = dH · [G; U]`` once ``out`` is on its way.

    ``hidden``: the saved gate/up pre-activations ``[B, T, 2f]`` (left intact); recomputed if
    None.
    """
    two_f, h = gu.shape
    f = two_f // 2
    x2, dy2 = x.reshape(-1, h), dy.reshape(-1, h)
    if hidden is None:
        hid = _pre_activations(x, gu, work)
    else:
        hid = work.get("hid", f, 2)
        hid.copy_(hidden)
    dm = work.get("dm", f)
    torch.mm(dy2, dn, out=dm.view(-1, f))
    dh, act = swiglu_pointwise_backward(dm, hid, work.get("s", f), work.get("act", f))
    dh2 = dh.view(-1, two_f)
    acc = out.dtype
    matmul(dh2.t(), x2, acc, out=out[: two_f * h].view(two_f, h))
    matmul(dy2.t(), act.view(-1, f), acc, out=out[two_f * h : 3 * f * h].view(h, f))
    return dh2


class _RingSchedule:
    """Weight ring of one call: every owner's slice width, group, options."""

    def __init__(self, group, options: EngineOptions, x: torch.Tensor, weights, sizes) -> None:
        self.group, self.options = group, options
        self.ring = comm.Ring(group)
        self.D, self.p = self.ring.size, self.ring.rank
        self.h = x.shape[-1]
        self.sizes = sizes or [weights[0].shape[0]] * self.D  # f_q of every owner q
        self.numel = 3 * self.h * max(self.sizes)
        self.acc = options.accum_for(x.dtype)

    def shards(self, weights):
        """Yield ``(t, (GU, Dn))`` of owner q = p - t: ``GU = [G_q; U_q]`` ``[2 f_q, h]`` and
        ``Dn_q [h, f_q]``, views of the ring buffer; the next one arrives while the caller works."""
        packed = comm.pack(weights, numel=self.numel)  # a copy: it may serve as a receive buffer
        for t, cur in circulate(self.ring, packed, self.options.overlap, reuse=True):
            f, h = self.sizes[(self.p - t) % self.D], self.h
            yield t, (cur[: 2 * f * h].view(2 * f, h), cur[2 * f * h : 3 * f * h].view(h, f))


def tsp_mlp_forward(sched: _RingSchedule, x: torch.Tensor, weights, keep_hidden: bool = False):
    """Forward ring: ``X_p [B, T, h]`` -> ``Y_p [B, T, h]``, plus, if ``keep_hidden``, every
    step's gate/up pre-activations, a list of D ``[B, T, 2 f_q]`` (else None)."""
    y = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    hidden = [] if keep_hidden else None
    work = _Workspace(x, max(sched.sizes))
    for _, (gu, dn) in sched.shards(weights):
        two_f = gu.shape[0]
        if keep_hidden:
            hid = F.linear(x, gu)
            hidden.append(hid)
        else:
            hid = _pre_activations(x, gu, work)
        hg, hu = hid.chunk(2, dim=-1)
        act = torch.ops.aten.silu.out(hg, out=work.get("act", two_f // 2)).mul_(hu)
        add_matmul(y.view(-1, sched.h), act.view(-1, act.shape[-1]), dn.t())
    return y.to(x.dtype), hidden


def tsp_mlp_backward(sched: _RingSchedule, dy: torch.Tensor, x: torch.Tensor, weights, hidden=None):
    """Backward rings: returns ``dX_p`` and the fully reduced gradients of this rank's shards.
    ``hidden``: what ``tsp_mlp_forward(keep_hidden=True)`` returned, or None to recompute."""
    dy = dy.contiguous()
    dx = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    owner_grads = GradientRing(sched.ring)
    work = _Workspace(x, max(sched.sizes))
    for t, (gu, dn) in sched.shards(weights):
        share = torch.empty(sched.numel, dtype=sched.acc, device=x.device)
        share[dn.numel() * 3 :].zero_()  # a smaller shard's padding travels (and is summed) too
        h_t = hidden[t] if hidden is not None else None
        dh = _swiglu_weight_grads(x, dy, gu, dn, share, work, h_t)
        owner_grads.add(t, share)  # on its way (the last hop too) while dX is computed
        add_matmul(dx.view(-1, sched.h), dh, gu)
    f, h = sched.sizes[sched.p], sched.h
    shapes = [torch.Size((f, h))] * 2 + [torch.Size((h, f))]
    grads = comm.unpack(owner_grads.result(), shapes)
    return dx.to(x.dtype), [gr.to(w.dtype) for gr, w in zip(grads, weights)]


class _TSPMLPFunction(torch.autograd.Function):
    """Autograd boundary of the ring schedule: saves X_p and the rank's own shards (plus every
    step's gate/up pre-activations, D x ``[B, S/D, 2 f_q]``, when ``options.recompute_mlp`` is
    off)."""

    @staticmethod
    def forward(ctx, group, options, sizes, x, g, u, dn):
        sched = _RingSchedule(group, options, x, (g, u, dn), sizes)
        keep = not options.recompute_mlp and any(ctx.needs_input_grad)
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
    options: EngineOptions,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """Ring SwiGLU of this rank's tokens: ``x [B, S/D, h]`` -> ``[B, S/D, h]`` with this rank's
    slices ``gate, up [f_p, h]`` and ``down [h, f_p]``; ``sizes [D]``: every rank's ``f_q``
    (``partition.split_sizes(F, D)``; None: all equal to this rank's)."""
    return _TSPMLPFunction.apply(group, options, sizes, x, gate, up, down)
