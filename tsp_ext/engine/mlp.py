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

Within a ring step the tokens are processed in tiles of ``options.mlp_tile`` rows (the weight
gradients accumulate over the tiles), so a step's intermediates are ``mlp_tile x 2f`` whatever
S/D is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm
from .options import EngineOptions
from .pointwise import add_matmul, from_saved, matmul, to_save
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
    """Flat buffers reused by every tile of every step of one ring pass (sized for the largest
    tile and shard): on CPU a fresh ``[n, 2f]`` tensor per step is a fresh mapping whose first
    touch page-faults."""

    def __init__(self, like: torch.Tensor, rows: int, f_max: int) -> None:
        self.like, self.rows, self.f_max, self.buffers = like, rows, f_max, {}

    def get(self, name: str, n: int, f: int, per_f: int = 1) -> torch.Tensor:
        """Buffer ``name`` as ``[n, per_f · f]`` for ``n`` rows of a shard of width ``f`` (its
        capacity: ``rows`` x ``per_f · f_max``)."""
        if name not in self.buffers:
            self.buffers[name] = self.like.new_empty(self.rows * per_f * self.f_max)
        return self.buffers[name][: n * per_f * f].view(n, per_f * f)


def _pre_activations(x2: torch.Tensor, gu: torch.Tensor, work: _Workspace) -> torch.Tensor:
    """``[X·Gᵀ | X·Uᵀ]`` ``[n, 2f]`` of ``x2 [n, h]`` and ``gu = [G; U]``, one GEMM into the
    workspace."""
    hid = work.get("hid", x2.shape[0], gu.shape[0] // 2, 2)
    return torch.mm(x2, gu.t(), out=hid)


def _swiglu_weight_grads(x2, dy2, gu, dn, out, work: _Workspace, hidden=None, add=False):
    """Backward of one shard's ``(silu(X·Gᵀ) ⊙ (X·Uᵀ))·Dnᵀ`` for the rows ``x2, dy2 [n, h]``
    with ``gu = [G; U]`` (``[2f, h]``): writes (``add``: adds) ``[dG; dU]`` (``[2f, h]``) and
    ``dDn`` (``[h, f]``) into ``out``, a flat buffer in the accumulation dtype laid out like the
    shard, and returns ``dH [n, 2f]`` (in ``work``, valid until the next tile), the gradient of
    the gate/up pre-activations: the caller adds ``dX = dH · [G; U]``.

    ``hidden``: the saved gate/up pre-activations ``[n, 2f]`` (left intact); recomputed if None.
    """
    two_f, h = gu.shape
    f, n = two_f // 2, x2.shape[0]
    if hidden is None:
        hid = _pre_activations(x2, gu, work)
    else:
        hid = work.get("hid", n, f, 2)
        hid.copy_(hidden)
    dm = torch.mm(dy2, dn, out=work.get("dm", n, f))
    dh, act = swiglu_pointwise_backward(dm, hid, work.get("s", n, f), work.get("act", n, f))
    d_gu, d_dn = out[: two_f * h].view(two_f, h), out[two_f * h : 3 * f * h].view(h, f)
    if add:
        add_matmul(d_gu, dh.t(), x2)
        add_matmul(d_dn, dy2.t(), act)
    else:
        matmul(dh.t(), x2, out.dtype, out=d_gu)
        matmul(dy2.t(), act, out.dtype, out=d_dn)
    return dh


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
        self.rows = x.shape[:-1].numel()  # B x S/D tokens
        self.tile = min(options.mlp_tile or self.rows, self.rows)

    def tiles(self) -> list[slice]:
        """The token rows of each tile, in order."""
        return [slice(r, min(r + self.tile, self.rows)) for r in range(0, self.rows, self.tile)]

    def workspace(self, x: torch.Tensor) -> _Workspace:
        return _Workspace(x, self.tile, max(self.sizes))

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
    x2, y2 = x.reshape(-1, sched.h), y.view(-1, sched.h)
    hidden = [] if keep_hidden else None
    work = sched.workspace(x)
    for _, (gu, dn) in sched.shards(weights):
        f = gu.shape[0] // 2
        if keep_hidden:
            hidden.append(F.linear(x, gu))
        for rows in sched.tiles():
            if keep_hidden:
                hid = hidden[-1].view(-1, 2 * f)[rows]
            else:
                hid = _pre_activations(x2[rows], gu, work)
            hg, hu = hid.chunk(2, dim=-1)
            act = torch.ops.aten.silu.out(hg, out=work.get("act", hid.shape[0], f)).mul_(hu)
            add_matmul(y2[rows], act, dn.t())
    return y.to(x.dtype), hidden


def tsp_mlp_backward(sched: _RingSchedule, dy: torch.Tensor, x: torch.Tensor, weights, hidden=None):
    """Backward rings: returns ``dX_p`` and the fully reduced gradients of this rank's shards.
    ``hidden``: what ``tsp_mlp_forward(keep_hidden=True)`` returned, or None to recompute."""
    dy2, x2 = dy.contiguous().view(-1, sched.h), x.reshape(-1, sched.h)
    dx = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    dx2 = dx.view(-1, sched.h)
    owner_grads = GradientRing(sched.ring)
    work = sched.workspace(x)
    tiles = sched.tiles()
    for t, (gu, dn) in sched.shards(weights):
        share = torch.empty(sched.numel, dtype=sched.acc, device=x.device)
        share[dn.numel() * 3 :].zero_()  # a smaller shard's padding travels (and is summed) too
        for i, rows in enumerate(tiles):
            h_t = hidden[t].view(-1, gu.shape[0])[rows] if hidden is not None else None
            dh = _swiglu_weight_grads(x2[rows], dy2[rows], gu, dn, share, work, h_t, add=i > 0)
            if i == len(tiles) - 1:
                owner_grads.add(t, share)  # on its way (the last hop too) while dX is computed
            add_matmul(dx2[rows], dh, gu)
    f, h = sched.sizes[sched.p], sched.h
    shapes = [torch.Size((f, h))] * 2 + [torch.Size((h, f))]
    grads = comm.unpack(owner_grads.result(), shapes)
    return dx.to(x.dtype), [gr.to(w.dtype) for gr, w in zip(grads, weights)]


class _TSPMLPFunction(torch.autograd.Function):
    """Autograd boundary of the ring schedule: saves X_p (as its RMSNorm's input when it is a
    norm's output: ``pointwise.to_save``) and the rank's own shards (plus every
    step's gate/up pre-activations, D x ``[B, S/D, 2 f_q]``, when ``options.recompute_mlp`` is
    off)."""

    @staticmethod
    def forward(ctx, group, options, sizes, x, g, u, dn):
        sched = _RingSchedule(group, options, x, (g, u, dn), sizes)
        keep = not options.recompute_mlp and any(ctx.needs_input_grad)
        y, hidden = tsp_mlp_forward(sched, x, (g, u, dn), keep_hidden=keep)
        ctx.sched, ctx.n_hidden = sched, len(hidden or ())
        x, norm_weight, ctx.eps = to_save(x)  # its norm's input when it is a norm's output
        ctx.save_for_backward(x, norm_weight, g, u, dn, *(hidden or ()))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, *weights = ctx.saved_tensors[:5]
        x = from_saved(x, norm_weight, ctx.eps)
        hidden = ctx.saved_tensors[5:] if ctx.n_hidden else None
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
