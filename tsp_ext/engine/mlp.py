"""TSP gated MLP (SwiGLU, or GeGLU: ``act``): weight shards travel a ring while each rank keeps
its tokens.

Rank p holds slice p of the intermediate dimension (rows of gate/up, columns of down; ``⌊F/D⌋``
or ``⌈F/D⌉`` of them, the first ``F mod D`` ranks one more) and the tokens of zigzag shard p. The
ring carries buffers sized to the largest shard; each step unpacks its owner's real shapes.
Forward:

    cur = (G_p, U_p, Dn_p); Y_p = 0
    for t in 0..D-1:                       # cur is the shard of owner p - t
        if t < D-1: send cur -> p+1, recv next <- p-1      # async, overlaps the matmuls
        Y_p += (act(X_p·Gᵀ) ⊙ (X_p·Uᵀ))·Dnᵀ      # act: SiLU, GELU or GELU-tanh
        wait; cur = next

Backward runs the same weight ring plus a second ring of gradient accumulators one step behind:
at step t >= 1 rank p adds its tokens' contribution to shard p - t's accumulator and passes it
on, so after the last hop every accumulator lands at its owner with all D contributions (the
owner adds its own, computed at t = 0). dX_p accumulates locally. Saved per rank: X_p and the
rank's own shards; the intermediate activations are recomputed shard by shard in backward.

Within a ring step the tokens are processed in tiles of ``options.mlp_tile`` rows (the weight
gradients accumulate over the tiles), so a step's intermediates are ``mlp_tile x 2f`` whatever
S/D is.

LoRA adapters (``engine.lora``) ride a second ring beside the base shards (they may be kept in a
wider dtype): gate/up's B rows, block-diagonal ``[2 f_q, r_g + r_u]``, add ``U·Bᵀ`` to the
pre-activations (``U`` made once from the replicated A's), and down's A columns ``[r_d, f_q]`` add
``drop(act)·Aᵀ`` into ``Z``, which down's replicated B maps into the output. Frozen bases get no
weight-gradient GEMMs: the gradient ring then carries the adapters' gradients only.
"""

from __future__ import annotations

import torch

from . import comm, nf4
from .lora import (
    LoraPlan,
    SeededDropout,
    block_diagonal,
    diagonal_blocks,
    input_projection,
    input_projection_backward,
    scaled_stack,
)
from .options import EngineOptions
from .pointwise import (
    add_matmul,
    from_saved,
    gate_activation,
    gate_activation_backward,
    matmul,
    to_save,
)
from .weight_ring import GradientRing, circulate


def swiglu_pointwise_backward(
    dm: torch.Tensor, hid: torch.Tensor, s=None, act=None, kind: str = "silu"
):
    """The elementwise part of the gated MLP's backward, in place: from ``dM = dY·Dn`` ``[B, T,
    f]`` and the gate/up pre-activations ``hid = [hg | hu]`` ``[B, T, 2f]`` (both overwritten),
    returns ``hid`` holding their gradients ``[dhg | dhu]`` (one buffer, so that both weight
    gradients are one GEMM) and the forward's activation ``act(hg) ⊙ hu`` ``[B, T, f]``, the
    input of Dn. ``s``, ``act``: ``[B, T, f]`` buffers to use (fresh ones if None); ``kind``:
    the gate's activation (``pointwise.GATE_ACTIVATIONS``)."""
    hg, hu = hid.chunk(2, dim=-1)
    s = gate_activation(hg, kind, s)
    act = torch.mul(s, hu) if act is None else torch.mul(s, hu, out=act)
    s.mul_(dm)  # dhu
    gate_activation_backward(dm.mul_(hu), hg, kind, out=hg)  # dhg, over hg
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


def _pre_activations(x2: torch.Tensor, shard: _Shard, work: _Workspace | None, u=None):
    """``[X·Gᵀ | X·Uᵀ]`` ``[n, 2f]`` of ``x2 [n, h]`` and ``shard.gu_use = [G; U]``, one GEMM
    into the workspace (a new tensor if None), plus the adapters' ``u · shard.b_inᵀ`` when they
    are not merged (``u [n, Σ r]``; None: merged or none)."""
    hid = work.get("hid", x2.shape[0], shard.f, 2) if work is not None else None
    hid = torch.mm(x2, shard.gu_use.t(), out=hid)
    if u is not None:
        add_matmul(hid, u, shard.b_in.t())
    return hid


class _Shard:
    """One ring step's shard of owner q: ``gu = [G_q; U_q]`` ``[2 f_q, h]``, ``dn = Dn_q [h,
    f_q]`` and the adapter pieces, ``b_in`` (gate/up's B rows, block-diagonal ``[2 f_q, Σ r]``)
    and ``a_out`` (down's A columns ``[r_d, f_q]``), each None without one. ``gu_use`` /
    ``dn_use``: what the step computes with, the shards merged with their adapters
    (``merge``) or the shards themselves."""

    def __init__(self, q: int, gu, dn, b_in=None, a_out=None) -> None:
        self.q, self.gu, self.dn, self.b_in, self.a_out = q, gu, dn, b_in, a_out
        self.f = dn.shape[1]
        self.gu_use, self.dn_use = gu, dn

    def merge(self, a_stack, b_out, s_out, in_place: bool = False) -> None:
        """``[G; U] + B_in · a_stack`` and ``Dn + s·B_out · A_out``: new tensors (the ring
        buffers travel on), or, ``in_place``, over ``gu`` and ``dn`` (the owner's copy, before
        it travels)."""
        if self.b_in is not None:
            b_in, a = self.b_in.to(self.gu.dtype), a_stack.to(self.gu.dtype)
            self.gu_use = (self.gu.addmm_ if in_place else self.gu.addmm)(b_in, a)
        if self.a_out is not None:
            b_out, a_out = b_out.to(self.dn.dtype), self.a_out.to(self.dn.dtype)
            self.dn_use = (self.dn.addmm_ if in_place else self.dn.addmm)(b_out, a_out, alpha=s_out)


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """``out = a @ b`` (``add``: ``out += a @ b``) at ``out``'s precision."""
    if add:
        add_matmul(out, a, b)
    else:
        matmul(a, b, out.dtype, out=out)


def _swiglu_weight_grads(
    x2, dy2, shard: _Shard, out, work: _Workspace, lora, hidden=None, kind: str = "silu"
):
    """Backward of one shard's ``(act(X·Gᵀ) ⊙ (X·Uᵀ))·Dnᵀ`` for the rows ``x2, dy2 [n, h]``:
    writes (``add``: adds) the gradients of the trainable pieces into ``out`` (a ``_GradLayout``
    of a flat buffer in the accumulation dtype) and returns ``dH [n, 2f]`` (in ``work``, valid
    until the next tile), the gradient of the gate/up pre-activations: the caller adds
    ``dX = dH · [G; U]`` and ``dU = dH · b_in``.

    ``lora = (u, dz, mask, add, z, merged)``: the tile's adapter input projection ``[n, Σ r]``
    (or None), down adapter's output gradient ``[n, r_d]`` (or None), its dropout mask ``[n, f]``
    (or None), whether ``out`` already holds earlier tiles' sums, the tile's rows of down
    adapter's ``Z`` (rebuilt here for its B's gradient; None without) and whether the shard's
    adapters are merged into ``gu_use`` / ``dn_use`` (then ``u`` and ``dZ`` add no terms).
    ``hidden``: the saved gate/up pre-activations ``[n, 2f]`` (left intact); recomputed if
    None. ``kind``: the gate's activation.
    """
    u, dz, mask, add, z, merged = lora
    f, n = shard.f, x2.shape[0]
    if hidden is None:
        hid = _pre_activations(x2, shard, work, None if merged else u)
    else:
        hid = work.get("hid", n, f, 2)
        hid.copy_(hidden)
    dm = torch.mm(dy2, shard.dn_use, out=work.get("dm", n, f))
    if dz is not None and not merged:  # the down adapter's share of d(act)
        d_act = matmul(dz, shard.a_out, dm.dtype)
        dm.add_(d_act if mask is None else d_act.mul_(mask))
    dh, act = swiglu_pointwise_backward(dm, hid, work.get("s", n, f), work.get("act", n, f), kind)
    if out.gu is not None:
        _accumulate(out.gu, dh.t(), x2, add)
        _accumulate(out.dn, dy2.t(), act, add)
    if out.b_in is not None:
        _accumulate(out.b_in, dh.t(), u, add)
    if dz is not None:
        dropped = act if mask is None else act * mask
        if out.a_out is not None:
            _accumulate(out.a_out, dz.t(), dropped, add)
        add_matmul(z, dropped, shard.a_out.t())
    return dh


class _GradLayout:
    """Views of a flat gradient buffer for one shard of width ``f``: the trainable pieces among
    ``gu [2f, h]``, ``dn [h, f]``, ``b_in [2f, Σ r]``, ``a_out [r_d, f]`` (others None)."""

    def __init__(self, flat: torch.Tensor, f: int, h: int, base: bool, r_in: int, r_out: int):
        shapes = {}
        if base:
            shapes.update(gu=(2 * f, h), dn=(h, f))
        if r_in:
            shapes["b_in"] = (2 * f, r_in)
        if r_out:
            shapes["a_out"] = (r_out, f)
        views = comm.unpack(flat, [torch.Size(s) for s in shapes.values()])
        named = dict(zip(shapes, views))
        self.gu, self.dn = named.get("gu"), named.get("dn")
        self.b_in, self.a_out = named.get("b_in"), named.get("a_out")
        self.used = sum(v.numel() for v in views)

    @staticmethod
    def numel(f: int, h: int, base: bool, r_in: int, r_out: int) -> int:
        return (3 * f * h if base else 0) + 2 * f * r_in + r_out * f


class _RingSchedule:
    """Weight ring of one call: every owner's slice width, group, options, the gate's
    activation, LoRA plan and which pieces get gradients (``base``: the gate/up/down shards;
    ``lora``: the adapters')."""

    def __init__(
        self,
        group,
        options: EngineOptions,
        x: torch.Tensor,
        weights,
        sizes,
        lora,
        adapters,
        activation: str = "silu",
    ) -> None:
        self.group, self.options, self.activation = group, options, activation
        self.ring = comm.Ring(group)
        self.D, self.p = self.ring.size, self.ring.rank
        self.h = x.shape[-1]
        self.sizes = sizes or [weights[0].shape[0]] * self.D  # f_q of every owner q
        self.dtype = x.dtype
        self.packed = weights[0].dtype == torch.uint8  # NF4 bytes (QLoRA): dequantized per step
        self.numel = max(self.base_numel(f) for f in self.sizes)
        self.acc = options.accum_for(x.dtype)
        self.rows = x.shape[:-1].numel()  # B x S/D tokens
        self.tile = min(options.mlp_tile or self.rows, self.rows)
        self.lora = lora or LoraPlan()
        b_in, a_out = adapters
        self.r_in = [b.shape[1] if b is not None else 0 for b in b_in]  # gate's, up's
        self.r_out = a_out.shape[0] if a_out is not None else 0
        self.drop = SeededDropout(self.lora.dropout, None)
        self.base_trainable = self.lora_trainable = True
        self.merged, self.a_stack, self.b_out = False, None, None

    def set_adapters(self, drop: SeededDropout, a_in: list, b_out) -> None:
        """This call's dropout and whether each shard is merged with its adapters (without
        active dropout: ``engine.lora``)."""
        self.drop, self.b_out = drop, b_out
        self.merged = not drop.active
        if self.merged and a_in:
            self.a_stack = scaled_stack(a_in, self.lora)

    def base_numel(self, f: int) -> int:
        """Ring-buffer elements of a ``[G; U; Dn]`` shard of width ``f`` (bytes if packed)."""
        if not self.packed:
            return 3 * self.h * f
        return 2 * nf4.packed_bytes(torch.Size((f, self.h))) + nf4.packed_bytes(
            torch.Size((self.h, f))
        )

    def base_views(self, cur: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[G; U]`` ``[2f, h]`` and ``Dn [h, f]`` of a ring buffer holding a width-``f`` shard
        (views; dequantized copies if packed)."""
        h = self.h
        if not self.packed:
            return cur[: 2 * f * h].view(2 * f, h), cur[2 * f * h : 3 * f * h].view(h, f)
        row, col = torch.Size((f, h)), torch.Size((h, f))
        n = nf4.packed_bytes(row)
        g, u = (nf4.unpack(cur[i * n : (i + 1) * n], row, self.dtype) for i in range(2))
        dn = nf4.unpack(cur[2 * n : 2 * n + nf4.packed_bytes(col)], col, self.dtype)
        return torch.cat([g, u]), dn

    @property
    def has_lora(self) -> bool:
        return sum(self.r_in) + self.r_out > 0

    def tiles(self) -> list[slice]:
        """The token rows of each tile, in order."""
        return [slice(r, min(r + self.tile, self.rows)) for r in range(0, self.rows, self.tile)]

    def workspace(self, x: torch.Tensor) -> _Workspace:
        return _Workspace(x, self.tile, max(self.sizes))

    def lora_numel(self, f: int) -> int:
        return 2 * f * sum(self.r_in) + self.r_out * f

    def grad_numel(self) -> int:
        """Size of a gradient-ring buffer (the largest shard's trainable pieces)."""
        f = max(self.sizes)
        base, r_in = self.base_trainable, sum(self.r_in) if self.lora_trainable else 0
        return _GradLayout.numel(f, self.h, base, r_in, self.r_out if self.lora_trainable else 0)

    def grad_layout(self, flat: torch.Tensor, f: int) -> _GradLayout:
        lora = self.lora_trainable
        r_in, r_out = (sum(self.r_in), self.r_out) if lora else (0, 0)
        return _GradLayout(flat, f, self.h, self.base_trainable, r_in, r_out)

    def shards(self, weights, adapters, backward: bool):
        """Yield ``(t, _Shard)`` of owner q = p - t, views of the ring buffers; the next one
        arrives while the caller works. ``adapters = ([B_gate, B_up], A_down)`` (entries None
        without an adapter): they travel a second ring, in their own dtype, where they are read:
        in ``backward``, or to be merged on arrival. Merged adapters (``set_adapters``) are
        merged into the owner's shard before it travels, once per pass instead of once per step
        on every rank, unless the shard travels NF4-packed: then each step merges on arrival."""
        packed = comm.pack(weights, numel=self.numel)  # a copy: it may serve as a receive buffer
        f_p = self.sizes[self.p]
        b_in, a_out = adapters
        own_b_in = block_diagonal(b_in, [f_p, f_p])
        premerged = self.merged and not self.packed
        if premerged and self.has_lora:
            own = _Shard(self.p, *self.base_views(packed, f_p), own_b_in, a_out)
            own.merge(self.a_stack, self.b_out, self.lora.output, in_place=True)
        base = circulate(self.ring, packed, self.options.overlap, reuse=True)
        lora = None
        if self.has_lora and (backward or not premerged):
            pieces = [t for t in (own_b_in, a_out) if t is not None]
            numel = self.lora_numel(max(self.sizes))
            lora = circulate(self.ring, comm.pack(pieces, numel=numel), self.options.overlap, True)
        for t, cur in base:
            q = (self.p - t) % self.D
            f = self.sizes[q]
            gu, dn = self.base_views(cur, f)
            b_in = a_out = None
            if lora is not None:
                _, extra = next(lora)
                r_in = sum(self.r_in)
                if r_in:
                    b_in = extra[: 2 * f * r_in].view(2 * f, r_in)
                if self.r_out:
                    a_out = extra[2 * f * r_in : self.lora_numel(f)].view(self.r_out, f)
            shard = _Shard(q, gu, dn, b_in, a_out)
            if self.merged and not premerged:
                shard.merge(self.a_stack, self.b_out, self.lora.output)
            yield t, shard


def tsp_mlp_forward(
    sched: _RingSchedule, x: torch.Tensor, weights, keep_hidden: bool = False, lora=None
):
    """Forward ring: ``X_p [B, T, h]`` -> ``Y_p [B, T, h]``, plus, if ``keep_hidden``, every
    step's gate/up pre-activations, a list of D ``[B, T, 2 f_q]`` (else None).
    ``lora = (A's of sched.lora.inputs, ([B_gate, B_up], A_down), B_down)`` or None."""
    y = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    x2, y2 = x.reshape(-1, sched.h), y.view(-1, sched.h)
    a_in, adapters, b_out = lora or ([], ([None, None], None), None)
    u = z = None
    if not sched.merged:  # the adapters' terms apart from the base's (dropout)
        u = input_projection(x2, a_in, sched.lora, sched.drop) if a_in else None
        z = x2.new_zeros(x2.shape[0], sched.r_out, dtype=sched.acc) if sched.r_out else None
    hidden = [] if keep_hidden else None
    work = sched.workspace(x)
    for _, shard in sched.shards(weights, adapters, backward=False):
        f = shard.f
        if keep_hidden:
            hidden.append(_pre_activations(x2, shard, None, u))
        for rows in sched.tiles():
            if keep_hidden:
                hid = hidden[-1][rows]
            else:
                hid = _pre_activations(x2[rows], shard, work, u[rows] if u is not None else None)
            hg, hu = hid.chunk(2, dim=-1)
            act = gate_activation(hg, sched.activation, work.get("act", hid.shape[0], f))
            act.mul_(hu)
            add_matmul(y2[rows], act, shard.dn_use.t())
            if z is not None:
                dropped = sched.drop.apply(act, (2, shard.q, rows.start))
                add_matmul(z[rows], dropped, shard.a_out.t())
    if z is not None:
        add_matmul(y2, z, (sched.lora.output * b_out).t())
    return y.to(x.dtype), hidden


def tsp_mlp_backward(
    sched: _RingSchedule, dy: torch.Tensor, x: torch.Tensor, weights, hidden=None, lora=None
):
    """Backward rings: returns ``dX_p``, the fully reduced gradients of this rank's trainable
    shards (``[dG, dU, dDn]`` or None; with adapters ``[dB_gate, dB_up]`` entries and ``dA_down``
    or None), this rank's partial gradients of the replicated A's and of down's replicated B (or
    None). ``hidden``: what ``tsp_mlp_forward(keep_hidden=True)`` returned, or None to recompute.
    ``lora``: as in the forward (``U`` and ``Z`` are rebuilt)."""
    dy2, x2 = dy.contiguous().view(-1, sched.h), x.reshape(-1, sched.h)
    dx = torch.zeros(x.shape, dtype=sched.acc, device=x.device)
    dx2 = dx.view(-1, sched.h)
    a_in, adapters, b_out = lora or ([], ([None, None], None), None)
    u = du = dz = z = None
    if a_in:
        u = input_projection(x2, a_in, sched.lora, sched.drop)
        du = torch.zeros_like(u, dtype=sched.acc)
    if b_out is not None:  # dZ needs only dY; Z is rebuilt tile by tile for B's gradient
        dz = matmul(dy2, sched.lora.output * b_out, sched.acc)
        z = torch.zeros_like(dz)
    owner_grads = GradientRing(sched.ring)
    work = sched.workspace(x)
    tiles = sched.tiles()
    numel = sched.grad_numel()
    for t, shard in sched.shards(weights, adapters, backward=True):
        share = torch.empty(numel, dtype=sched.acc, device=x.device)
        layout = sched.grad_layout(share, shard.f)
        share[layout.used :].zero_()  # a smaller shard's padding travels (and is summed) too
        for i, rows in enumerate(tiles):
            h_t = hidden[t][rows] if hidden is not None else None
            u_t = u[rows] if u is not None else None
            dz_t = dz[rows] if dz is not None else None
            mask = None
            if dz_t is not None:
                like = x2.new_empty(rows.stop - rows.start, shard.f)
                mask = sched.drop.mask((2, shard.q, rows.start), like)
            z_t = z[rows] if z is not None else None
            tile_lora = (u_t, dz_t, mask, i > 0, z_t, sched.merged)
            dh = _swiglu_weight_grads(
                x2[rows], dy2[rows], shard, layout, work, tile_lora, h_t, sched.activation
            )
            if i == len(tiles) - 1 and numel:
                owner_grads.add(t, share)  # on its way (the last hop too) while dX is computed
            add_matmul(dx2[rows], dh, shard.gu_use)
            if shard.b_in is not None:
                add_matmul(du[rows], dh, shard.b_in)
    f = sched.sizes[sched.p]
    own = sched.grad_layout(owner_grads.result() if numel else share, f)
    base = None
    if own.gu is not None:
        base = [t.to(w.dtype) for t, w in zip((*own.gu.chunk(2), own.dn), weights)]
    b_in, a_out = adapters
    d_b = [None, None]
    if own.b_in is not None:
        present = [b is not None for b in b_in]
        ranks = [b.shape[1] for b in b_in if b is not None]
        blocks = diagonal_blocks(own.b_in, present, [f, f], ranks)
        it = iter(blocks)
        d_b = [next(it).to(b.dtype) if b is not None else None for b in b_in]
    d_a_out = own.a_out.to(a_out.dtype) if own.a_out is not None else None
    d_a_in = []
    if du is not None:
        dx_adapter = None if sched.merged else dx2  # merged: dX has it already
        d_a_in = input_projection_backward(du, x2, a_in, sched.lora, sched.drop, dx_adapter)
        d_a_in = [g.to(a.dtype) for g, a in zip(d_a_in, a_in)]
    d_b_out = None
    if b_out is not None:
        d_b_out = matmul(dy2.t(), z, sched.acc).mul_(sched.lora.output).to(b_out.dtype)
    return dx.to(x.dtype), base, (d_b, d_a_out), d_a_in, d_b_out


class _TSPMLPFunction(torch.autograd.Function):
    """Autograd boundary of the ring schedule: saves X_p (as its RMSNorm's input when it is a
    norm's output: ``pointwise.to_save``) and the rank's own shards (plus every
    step's gate/up pre-activations, D x ``[B, S/D, 2 f_q]``, when ``options.recompute_mlp`` is
    off), and with adapters their pieces. Inputs after the base shards: the ``n_in``
    replicated A's, gate's and up's B rows, down's A columns, down's replicated B (each None
    without an adapter)."""

    @staticmethod
    def forward(ctx, group, options, sizes, activation, plan, n_in, x, gate, up, down, *lora):
        a_in, b_gate, b_up, a_out, b_out = list(lora[:n_in]), *lora[n_in:]
        adapters = ([b_gate, b_up], a_out)
        weights = (gate, up, down)
        sched = _RingSchedule(group, options, x, weights, sizes, plan, adapters, activation)
        grad = any(ctx.needs_input_grad)
        sched.base_trainable = any(ctx.needs_input_grad[7:10])
        sched.lora_trainable = any(ctx.needs_input_grad[10 + n_in : 13 + n_in])
        sched.set_adapters(SeededDropout.for_call(sched.lora.dropout), a_in, b_out)
        keep = not options.recompute_mlp and grad
        y, hidden = tsp_mlp_forward(sched, x, weights, keep, (a_in, adapters, b_out))
        ctx.sched, ctx.n_hidden, ctx.n_in = sched, len(hidden or ()), n_in
        x, norm_weight, ctx.norm = to_save(x)  # its norm's input when it is a norm's output
        ctx.save_for_backward(x, norm_weight, *weights, *lora, *(hidden or ()))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, gate, up, down, *rest = ctx.saved_tensors
        n_lora = ctx.n_in + 4
        lora, hidden = rest[:n_lora], rest[n_lora:] or None
        a_in, b_gate, b_up, a_out, b_out = list(lora[: ctx.n_in]), *lora[ctx.n_in :]
        x = from_saved(x, norm_weight, ctx.norm)
        adapters = ([b_gate, b_up], a_out)
        dx, base, (d_b, d_a_out), d_a_in, d_b_out = tsp_mlp_backward(
            ctx.sched, dy, x, (gate, up, down), hidden, (a_in, adapters, b_out)
        )
        base = base or (None, None, None)
        return (None,) * 6 + (dx, *base, *d_a_in, *d_b, d_a_out, d_b_out)


def tsp_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    group,
    options: EngineOptions,
    sizes: list[int] | None = None,
    lora: LoraPlan | None = None,
    adapters: dict[str, torch.Tensor] | None = None,
    activation: str = "silu",
):
    """Ring gated MLP of this rank's tokens: ``x [B, S/D, h]`` -> ``[B, S/D, h]`` with this
    rank's slices ``gate, up [f_p, h]`` and ``down [h, f_p]``; ``sizes [D]``: every rank's
    ``f_q`` (``partition.split_sizes(F, D)``; None: all equal to this rank's); ``activation``:
    the gate's (``pointwise.GATE_ACTIVATIONS``: SwiGLU with ``"silu"``).

    LoRA (``engine.lora``): ``lora`` names the adapted projections and ``adapters`` holds their
    pieces: the replicated A's ``a_gate, a_up [r, h]`` (their gradient is this rank's part: wrap
    them in ``comm.replicated``), this rank's B rows ``b_gate, b_up [f_p, r]``, down's A
    columns ``a_down [r, f_p]`` and down's replicated B ``b_down [h, r]`` (wrapped alike).
    """
    adapters = adapters or {}
    plan = lora or LoraPlan()
    a_in = [adapters[f"a_{n}"] for n in plan.inputs]
    extra = [adapters.get(n) for n in ("b_gate", "b_up", "a_down", "b_down")]
    return _TSPMLPFunction.apply(
        group, options, sizes, activation, plan, len(a_in), x, gate, up, down, *a_in, *extra
    )
