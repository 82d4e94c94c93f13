"""TSP mixture-of-experts MLP: every expert's intermediate slice travels the ring while each rank
keeps its tokens (the dense MLP's weight ring, ``engine.mlp``, for E experts at once).

Rank p holds slice p of every expert's intermediate dimension, ``gate, up [E, f_p, h]`` and
``down [E, h, f_p]`` (``⌊F/D⌋`` or ``⌈F/D⌉`` rows, as the dense MLP), and the tokens of zigzag
shard p. The router is replicated, so each rank routes its own tokens: ``index, weight [n, k]``,
each token's top-k experts and their weights. Forward:

    cur = (G_p, U_p, Dn_p) of every expert; Y_p = 0
    for t in 0..D-1:                            # cur: every expert's slice of owner p - t
        if t < D-1: send cur -> p+1, recv next <- p-1        # async, overlaps the matmuls
        for each expert e, its tokens X_e (the rows of X_p routed to e), their weights w_e:
            Y_p[rows of e] += w_e · (act(X_e·G_eᵀ) ⊙ (X_e·U_eᵀ))·Dn_eᵀ
        wait; cur = next

Tokens never move and no rank holds a whole expert, so there is no all-to-all and no capacity:
every routed token is computed (dropless). Backward runs the weight ring again with the dense
MLP's gradient ring one step behind, recomputing each expert's activations, and returns the
routing weights' gradient ``<dY, expert output>`` (summed over the D slices). Saved per rank:
X_p, the routing ``[n, k]`` and the rank's own slices.
"""

from __future__ import annotations

import torch

from . import comm
from .mlp import swiglu_pointwise_backward
from .options import EngineOptions
from .pointwise import add_matmul, from_saved, gate_activation, matmul, to_save
from .weight_ring import GradientRing, circulate


class Routing:
    """The assignments of ``n`` tokens to experts, grouped by expert: ``index [n, k]`` ->
    ``slots [n·k]`` (positions in the flat ``[n·k]`` routing, sorted by expert, stable),
    ``tokens [n·k]`` (their tokens) and ``groups``, ``(expert, rows)`` for each expert with
    tokens (``rows``: its slice of ``slots`` / ``tokens``)."""

    def __init__(self, index: torch.Tensor, n_experts: int) -> None:
        flat = index.reshape(-1)
        self.slots = torch.argsort(flat, stable=True)
        self.tokens = self.slots // index.shape[1]
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        starts = [sum(counts[:e]) for e in range(n_experts)]
        self.groups = [(e, slice(s, s + c)) for e, (s, c) in enumerate(zip(starts, counts)) if c]


class _ExpertRing:
    """The weight ring of one call: every owner's slice width ``sizes [D]``, the experts' count
    and hidden size, and the gate's activation. A ring buffer holds one owner's slices of every
    expert, ``[G; U]`` ``[E, 2f, h]`` then ``Dn [E, h, f]``, padded to the largest owner's."""

    def __init__(self, group, options: EngineOptions, x, down, sizes, activation: str) -> None:
        self.options, self.activation = options, activation
        self.ring = comm.Ring(group)
        self.D, self.p = self.ring.size, self.ring.rank
        self.n_experts, self.h = down.shape[0], down.shape[1]
        self.sizes = sizes or [down.shape[2]] * self.D
        self.acc = options.accum_for(x.dtype)

    def numel(self, f: int) -> int:
        return 3 * self.n_experts * f * self.h

    def views(self, flat: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[G; U]`` ``[E, 2f, h]`` and ``Dn [E, h, f]`` of a buffer holding width-``f``
        slices."""
        E, h = self.n_experts, self.h
        return flat[: 2 * E * f * h].view(E, 2 * f, h), flat[2 * E * f * h : 3 * E * f * h].view(
            E, h, f
        )

    def shards(self, gate, up, down):
        """Yield ``(t, f, [G; U], Dn)`` of owner q = p - t (views of the ring buffer, valid until
        the next step); the next owner's arrive while the caller works."""
        packed = comm.pack([torch.cat([gate, up], dim=1), down], numel=self.numel(max(self.sizes)))
        for t, cur in circulate(self.ring, packed, self.options.overlap, reuse=True):
            f = self.sizes[(self.p - t) % self.D]
            yield (t, f, *self.views(cur, f))


def _expert_rows(x2: torch.Tensor, routing: Routing, rows: slice) -> torch.Tensor:
    """The tokens of one expert's assignments, ``[c, h]`` (a gathered copy)."""
    return x2.index_select(0, routing.tokens[rows])


def expert_ring_forward(
    ring: _ExpertRing, x2: torch.Tensor, weights, routing: Routing, scale: torch.Tensor
) -> torch.Tensor:
    """``x2 [n, h]`` -> ``Y [n, h]`` (in the accumulation dtype): every token's routed experts,
    weighted by ``scale [n·k]`` (the routing weights in ``routing.slots`` order)."""
    y = torch.zeros(x2.shape, dtype=ring.acc, device=x2.device)
    for _, _, gu, dn in ring.shards(*weights):
        for e, rows in routing.groups:
            hid = torch.mm(_expert_rows(x2, routing, rows), gu[e].t())
            hg, hu = hid.chunk(2, dim=-1)
            act = gate_activation(hg, ring.activation).mul_(hu)
            out = matmul(act, dn[e].t(), ring.acc).mul_(scale[rows, None])
            y.index_add_(0, routing.tokens[rows], out)
    return y


def expert_ring_backward(
    ring: _ExpertRing,
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weights,
    routing: Routing,
    scale: torch.Tensor,
    weight_grads: bool,
):
    """Backward rings: returns ``dX [n, h]`` and ``d scale [n·k]`` (accumulation dtype) and, if
    ``weight_grads``, this rank's slices' gradients ``(dG, dU, dDn)`` summed over every rank's
    tokens (else None)."""
    dx = torch.zeros(x2.shape, dtype=ring.acc, device=x2.device)
    d_scale = torch.zeros_like(scale)
    owner_grads = GradientRing(ring.ring)
    numel = ring.numel(max(ring.sizes))
    for t, f, gu, dn in ring.shards(*weights):
        if weight_grads:
            share = torch.zeros(numel, dtype=ring.acc, device=x2.device)
            d_gu, d_dn = ring.views(share, f)
        for e, rows in routing.groups:
            xe, dye = _expert_rows(x2, routing, rows), _expert_rows(dy2, routing, rows)
            hid = torch.mm(xe, gu[e].t())
            d_out = torch.mm(dye, dn[e])  # dY·Dn before the routing weight [c, f]
            dm = d_out * scale[rows, None].to(d_out.dtype)
            dh, act = swiglu_pointwise_backward(dm, hid, kind=ring.activation)
            d_scale[rows] += (d_out * act).sum(dim=-1, dtype=ring.acc)
            if weight_grads:
                add_matmul(d_gu[e], dh.t(), xe)
                act.mul_(scale[rows, None].to(act.dtype))
                add_matmul(d_dn[e], dye.t(), act)
            dx.index_add_(0, routing.tokens[rows], matmul(dh, gu[e], ring.acc))
        if weight_grads:
            owner_grads.add(t, share)  # on its way while the next owner's slices are used
    if not weight_grads:
        return dx, d_scale, None
    own = owner_grads.result()
    d_gu, d_dn = ring.views(own, ring.sizes[ring.p])
    d_gate, d_up = d_gu.chunk(2, dim=1)
    return dx, d_scale, tuple(g.to(w.dtype) for g, w in zip((d_gate, d_up, d_dn), weights))


class _ExpertRingFunction(torch.autograd.Function):
    """Autograd boundary of the expert ring: saves X_p (as its RMSNorm's input when it is a
    norm's output: ``pointwise.to_save``), the routing ``index, weight [n, k]`` and the rank's
    own slices."""

    @staticmethod
    def forward(ctx, group, options, sizes, activation, x, index, weight, gate, up, down):
        ring = _ExpertRing(group, options, x, down, sizes, activation)
        x2 = x.reshape(-1, ring.h)
        routing = Routing(index, ring.n_experts)
        scale = weight.reshape(-1)[routing.slots].to(ring.acc)
        y = expert_ring_forward(ring, x2, (gate, up, down), routing, scale)
        ctx.ring = ring
        saved, norm_weight, ctx.norm = to_save(x)
        ctx.save_for_backward(saved, norm_weight, index, weight, gate, up, down)
        return y.to(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, index, weight, gate, up, down = ctx.saved_tensors
        ring = ctx.ring
        x = from_saved(x, norm_weight, ctx.norm)
        routing = Routing(index, ring.n_experts)
        scale = weight.reshape(-1)[routing.slots].to(ring.acc)
        dy2 = dy.contiguous().view(-1, ring.h)
        weight_grads = any(ctx.needs_input_grad[7:10])
        dx, d_scale, d_w = expert_ring_backward(
            ring, dy2, x.reshape(-1, ring.h), (gate, up, down), routing, scale, weight_grads
        )
        d_weight = torch.zeros_like(scale).index_put_((routing.slots,), d_scale)
        d_weight = d_weight.view(weight.shape).to(weight.dtype)
        return (None,) * 4 + (dx.to(x.dtype).view(x.shape), None, d_weight, *(d_w or (None,) * 3))


class _RouterLogits(torch.autograd.Function):
    """``x·Wᵀ`` ``[n, E]`` of ``x [B, T, h]``, saving x as its RMSNorm's input when it is a
    norm's output (``pointwise.to_save``): the router adds no ``[B, T, h]`` tensor to what a
    layer saves."""

    @staticmethod
    def forward(ctx, x, weight):
        saved, norm_weight, ctx.norm = to_save(x)
        ctx.save_for_backward(saved, norm_weight, weight)
        return x.reshape(-1, x.shape[-1]) @ weight.t()

    @staticmethod
    def backward(ctx, d_logits):
        x, norm_weight, weight = ctx.saved_tensors
        x = from_saved(x, norm_weight, ctx.norm)
        dx = (d_logits @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = d_logits.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's logits ``[B·T, E]`` of tokens ``x [B, T, h]`` (``weight [E, h]``)."""
    return _RouterLogits.apply(x, weight)


def tsp_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    group,
    options: EngineOptions,
    sizes: list[int] | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Routed experts of this rank's tokens: ``x [B, S/D, h]`` -> ``[B, S/D, h]``, each token the
    sum of its experts ``index [n, k]`` (``n = B·S/D``, rows in x's order) times their routing
    weights ``weight [n, k]`` (differentiable); this rank's slices of every expert ``gate, up
    [E, f_p, h]``, ``down [E, h, f_p]``; ``sizes [D]``: every rank's ``f_q`` (None: all equal to
    this rank's); ``activation``: the gate's (``pointwise.GATE_ACTIVATIONS``)."""
    return _ExpertRingFunction.apply(
        group, options, sizes, activation, x, index, weight, gate, up, down
    )


def decode_experts(x, index, weight, gate, up, down, group, acc, activation: str = "silu"):
    """Routed experts of the replicated decode tokens ``x [B, Tq, h]`` (routing ``index, weight
    [B·Tq, k]``, the same on every rank) with this rank's slices: each rank's partial sums over
    its slices, then one all-reduce; ``[B, Tq, h]`` in x's dtype, identical on every rank."""
    x2 = x.reshape(-1, x.shape[-1])
    routing = Routing(index, down.shape[0])
    scale = weight.reshape(-1)[routing.slots].to(acc)
    y = torch.zeros(x2.shape, dtype=acc, device=x.device)
    for e, rows in routing.groups:
        xe = _expert_rows(x2, routing, rows)
        act = gate_activation(xe @ gate[e].t(), activation).mul_(xe @ up[e].t())
        y.index_add_(0, routing.tokens[rows], matmul(act, down[e].t(), acc).mul_(scale[rows, None]))
    comm.all_reduce(y, group)
    return y.to(x.dtype).view(x.shape)
