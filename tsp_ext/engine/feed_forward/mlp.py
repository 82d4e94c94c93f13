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

LoRA adapters (``hooks.MlpRingAdapters``, the hook called at fixed points of each step and tile)
ride a second ring beside the base shards and are merged into them without active dropout; NF4
shards (QLoRA's frozen base) travel packed and are dequantized per step (``nf4.StackedShard``).
Frozen bases get no weight-gradient GEMMs: the gradient ring then carries the adapters' only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.hooks import MlpLora, MlpRingAdapters, MlpStepAdapters
from ..adapters.lora import LoraPlan, SeededDropout
from ..adapters.nf4 import StackedShard
from ..kernels.pointwise import (
    add_matmul,
    from_saved,
    gate_activation,
    gate_activation_backward,
    matmul_into,
    round_in_place,
    to_save,
)
from ..options import EngineOptions
from ..parallel import comm
from ..parallel.weight_ring import GradientRing, circulate


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


def _pre_activations(x2, shard: _Shard, ad: MlpRingAdapters, rows: slice, work=None):
    """``[X·Gᵀ | X·Uᵀ]`` ``[n, 2f]`` of the token ``rows`` ``x2 [n, h]`` and ``shard.gu_use =
    [G; U]``, one GEMM into the workspace (a new tensor if None), plus the adapters' term."""
    hid = work.get("hid", x2.shape[0], shard.f, 2) if work is not None else None
    hid = torch.mm(x2, shard.gu_use.t(), out=hid)
    ad.add_input(hid, rows, shard.lora)
    return hid


class _Shard:
    """One ring step's shard of owner q: ``gu = [G_q; U_q]`` ``[2 f_q, h]``, ``dn = Dn_q [h,
    f_q]`` and ``lora``, the adapter pieces that travel with it. ``gu_use`` / ``dn_use``: what
    the step computes with, the shards merged with their adapters or the shards themselves."""

    def __init__(self, q: int, gu, dn, lora: MlpStepAdapters) -> None:
        self.q, self.gu, self.dn, self.lora = q, gu, dn, lora
        self.f = dn.shape[1]
        self.gu_use, self.dn_use = gu, dn


class _Grads:
    """Views of a flat gradient-ring buffer for one shard of width ``f``: ``gu [2f, h]`` and
    ``dn [h, f]`` when the base is trainable (else None), then the adapters' (``lora``);
    ``used``: the elements they cover."""

    def __init__(self, flat: torch.Tensor, f: int, h: int, base: bool, ad: MlpRingAdapters):
        n = 3 * f * h if base else 0
        self.gu = flat[: 2 * f * h].view(2 * f, h) if base else None
        self.dn = flat[2 * f * h : n].view(h, f) if base else None
        self.lora = ad.grad_views(flat[n:], f)
        self.used = n + ad.grad_numel(f)


@dataclass(frozen=True)
class _Pass:
    """What every tile of one backward pass shares: the adapter hook ``ad``, the workspace
    ``work`` and the gate's activation ``kind``."""

    ad: MlpRingAdapters
    work: _Workspace
    kind: str


def _weight_grads(x2, dy2, shard: _Shard, out: _Grads, *, tile, run: _Pass, add: bool, hidden):
    """Backward of one shard's ``(act(X·Gᵀ) ⊙ (X·Uᵀ))·Dnᵀ`` for the rows ``x2, dy2 [n, h]`` of
    ``tile`` (``hooks.MlpAdapterTile``): writes (``add``: adds) the gradients of the trainable
    pieces into ``out`` and returns ``dH [n, 2f]`` (in ``run.work``, valid until the next tile),
    the gradient of the gate/up pre-activations: the caller adds ``dX = dH · [G; U]``.
    ``hidden``: the saved gate/up pre-activations ``[n, 2f]`` (left intact); recomputed if
    None."""
    f, n, ad, work = shard.f, x2.shape[0], run.ad, run.work
    if hidden is None:
        hid = _pre_activations(x2, shard, ad, tile.rows, work=work)
    else:
        hid = work.get("hid", n, f, 2)
        hid.copy_(hidden)
    dm = torch.mm(dy2, shard.dn_use, out=work.get("dm", n, f))
    ad.add_d_act(dm, tile)
    s, act = work.get("s", n, f), work.get("act", n, f)
    dh, act = swiglu_pointwise_backward(dm, hid, s=s, act=act, kind=run.kind)
    if out.gu is not None:
        matmul_into(out.gu, dh.t(), x2, add)
        matmul_into(out.dn, dy2.t(), act, add)
    ad.add_grads(out.lora, dh, act, tile, add=add)
    return dh


@dataclass(frozen=True)
class MlpSpec:
    """What a ring MLP layer is: its TSP ``group``, engine ``options``, every rank's slice width
    ``sizes [D]`` (``partition.split_sizes(F, D)``; None: all equal to this rank's) and the
    gate's ``activation`` (``pointwise.GATE_ACTIVATIONS``: SwiGLU with ``"silu"``)."""

    group: object
    options: EngineOptions
    sizes: tuple[int, ...] | None = None
    activation: str = "silu"


class _RingSchedule:
    """Weight ring of one call: every owner's slice width, group, options, the gate's
    activation, the shards' ring-buffer form, the LoRA plan and this call's dropout, and which
    pieces get gradients (``base``: the gate/up/down shards; ``lora``: the travelling
    adapters')."""

    def __init__(self, spec: MlpSpec, x, weights, plan: LoraPlan) -> None:
        self.group, self.options, self.activation = spec.group, spec.options, spec.activation
        self.channel = comm.Ring(spec.group)
        self.D, self.p = self.channel.size, self.channel.rank
        self.h = x.shape[-1]
        self.sizes = list(spec.sizes or [weights[0].shape[0]] * self.D)  # f_q of every owner q
        self.codec = StackedShard(weights[0].dtype == torch.uint8, x.dtype)  # uint8: NF4
        self.numel = max(self.codec.numel(self.shapes(f)) for f in self.sizes)
        self.acc = spec.options.accum_for(x.dtype)
        self.rows = x.shape[:-1].numel()  # B x S/D tokens
        self.tile = min(spec.options.mlp_tile or self.rows, self.rows)
        self.plan = plan
        self.drop = SeededDropout.for_call(self.plan.dropout)
        self.base_trainable = self.lora_trainable = True

    def shapes(self, f: int) -> list[list[tuple[int, int]]]:
        """A width-``f`` shard in the ring buffer: ``[G; U]`` (``[f, h]`` each) and ``Dn``."""
        return [[(f, self.h), (f, self.h)], [(self.h, f)]]

    def adapters(self, lora: MlpLora) -> MlpRingAdapters:
        """The adapter hook of one pass with this rank's adapter tensors ``lora``."""
        f_p = self.sizes[self.p]
        return MlpRingAdapters(
            self.plan,
            self.drop,
            lora,
            f_p,
            acc=self.acc,
            trainable=self.lora_trainable,
            packed=self.codec.packed,
        )

    def tiles(self) -> list[slice]:
        """The token rows of each tile, in order."""
        return [slice(r, min(r + self.tile, self.rows)) for r in range(0, self.rows, self.tile)]

    def workspace(self, x: torch.Tensor) -> _Workspace:
        return _Workspace(x, self.tile, max(self.sizes))

    def grads(self, flat: torch.Tensor, f: int, ad: MlpRingAdapters) -> _Grads:
        return _Grads(flat, f, self.h, base=self.base_trainable, ad=ad)

    def grad_numel(self, ad: MlpRingAdapters) -> int:
        """Size of a gradient-ring buffer (the largest shard's trainable pieces)."""
        f = max(self.sizes)
        return (3 * f * self.h if self.base_trainable else 0) + ad.grad_numel(f)

    def shards(self, weights, ad: MlpRingAdapters, backward: bool):
        """Yield ``(t, _Shard)`` of owner q = p - t, views of the ring buffers; the next one
        arrives while the caller works. The adapter pieces ride their own ring beside it
        (``ad.circulate``); merged adapters are merged by the owner before its shard travels
        (``ad.premerged``) or by each receiver."""
        buf = comm.pack(weights, numel=self.numel)  # a copy: it may serve as a receive buffer
        if ad.premerged:
            gu, dn = self.codec.decode(buf, self.shapes(self.sizes[self.p]))
            ad.merge(gu, dn, ad.own, in_place=True)
        base = circulate(self.channel, buf, self.options.overlap, reuse=True)
        steps = ad.circulate(self.channel, self.sizes, self.options.overlap, backward)
        for t, cur in base:
            q = (self.p - t) % self.D
            gu, dn = self.codec.decode(cur, self.shapes(self.sizes[q]))
            shard = _Shard(q, gu, dn, next(steps))
            shard.gu_use, shard.dn_use = ad.on_arrival(gu, dn, shard.lora)
            yield t, shard


def tsp_mlp_forward(
    ring: _RingSchedule, x: torch.Tensor, weights, lora: MlpLora, keep_hidden: bool = False
):
    """Forward ring: ``X_p [B, T, h]`` -> ``Y_p [B, T, h]``, plus, if ``keep_hidden``, every
    step's gate/up pre-activations, a list of D ``[B, T, 2 f_q]`` (else None). ``lora``: this
    rank's adapter tensors (``MlpLora()`` without)."""
    y = torch.zeros(x.shape, dtype=ring.acc, device=x.device)
    x2, y2 = x.reshape(-1, ring.h), y.view(-1, ring.h)
    ad = ring.adapters(lora)
    ad.start_forward(x2)
    hidden = [] if keep_hidden else None
    work = ring.workspace(x)
    for _, shard in ring.shards(weights, ad, backward=False):
        if keep_hidden:
            hidden.append(_pre_activations(x2, shard, ad, slice(None)))
        for rows in ring.tiles():
            tile = ad.tile(rows, shard.q, shard.f, shard.lora)
            if keep_hidden:
                hid = hidden[-1][rows]
            else:
                hid = _pre_activations(x2[rows], shard, ad, rows, work=work)
            hg, hu = hid.chunk(2, dim=-1)
            act = gate_activation(hg, ring.activation, work.get("act", hid.shape[0], shard.f))
            act.mul_(hu)
            add_matmul(y2[rows], act, shard.dn_use.t())
            ad.add_output(act, tile)
    ad.finish_forward(y2)
    return round_in_place(y, x.dtype), hidden


def _input_rows(ring: _RingSchedule, saved: tuple, lora: MlpLora):
    """X_p's rows as the backward reads them, from ``saved`` (``pointwise.to_save``'s triple):
    the whole rebuilt input (with ``overlap``, or adapters, which read all of it) or, memory
    before speed, each tile's rows rebuilt from its norm's input when used, so that no
    ``[B, S/D, h]`` normed copy lives through the rings. Returns ``(x2 or None, rows_of)``."""
    x, weight, norm = saved
    if weight is None or ring.options.overlap or any(t is not None for t in lora.flatten()):
        x2 = from_saved(*saved).reshape(-1, ring.h)
        return x2, x2.__getitem__
    inputs = x.reshape(-1, ring.h)
    return None, lambda rows: from_saved(inputs[rows], weight, norm)


def tsp_mlp_backward(
    ring: _RingSchedule, dy: torch.Tensor, saved: tuple, weights, lora: MlpLora, hidden=None
):
    """Backward rings: returns ``dX_p``, the fully reduced gradients of this rank's base shards
    (``[dG, dU, dDn]``, or None if frozen) and the adapters' (``MlpLora``: this rank's B rows
    and down's A columns fully reduced, the replicated A's and down's B partial). ``saved``:
    ``pointwise.to_save`` of X_p; ``hidden``: what ``tsp_mlp_forward(keep_hidden=True)``
    returned, or None to recompute."""
    x = saved[0]
    dy2 = dy.contiguous().view(-1, ring.h)
    x2, rows_of = _input_rows(ring, saved, lora)
    dx = torch.zeros(x.shape, dtype=ring.acc, device=x.device)
    dx2 = dx.view(-1, ring.h)
    ad = ring.adapters(lora)
    ad.start_backward(x2, dy2)
    owner_grads = GradientRing(ring.channel)
    run = _Pass(ad, ring.workspace(x), ring.activation)
    tiles = ring.tiles()
    numel = ring.grad_numel(ad)
    for t, shard in ring.shards(weights, ad, backward=True):
        share = torch.empty(numel, dtype=ring.acc, device=x.device)
        grads = ring.grads(share, shard.f, ad)
        share[grads.used :].zero_()  # a smaller shard's padding travels (and is summed) too
        for i, rows in enumerate(tiles):
            tile = ad.tile(rows, shard.q, shard.f, shard.lora)
            h_t = hidden[t][rows] if hidden is not None else None
            dh = _weight_grads(
                rows_of(rows), dy2[rows], shard, grads, tile=tile, run=run, add=i > 0, hidden=h_t
            )
            if i == len(tiles) - 1 and numel:
                owner_grads.add(t, share)  # on its way (the last hop too) while dX is computed
            add_matmul(dx2[rows], dh, shard.gu_use)
            ad.add_d_input(dh, tile)
    own = ring.grads(owner_grads.result() if numel else share, ring.sizes[ring.p], ad)
    base = None
    if own.gu is not None:
        base = [t.to(w.dtype) for t, w in zip((*own.gu.chunk(2), own.dn), weights)]
    d_lora = ad.finish_backward(own.lora, dy2, dx2)  # adds the adapters' dX if not merged
    return round_in_place(dx, x.dtype), base, d_lora


class _TSPMLPFunction(torch.autograd.Function):
    """Autograd boundary of the ring schedule: saves X_p (as its RMSNorm's input when it is a
    norm's output: ``pointwise.to_save``) and the rank's own shards (plus every
    step's gate/up pre-activations, D x ``[B, S/D, 2 f_q]``, when ``options.recompute_mlp`` is
    off), and with adapters their tensors. Inputs after the base shards: ``MlpLora.flatten()``
    (the replicated A's of ``ring.plan.inputs``, gate's and up's B rows, down's A columns,
    down's replicated B; each None without an adapter)."""

    @staticmethod
    def forward(ctx, ring: _RingSchedule, x, gate, up, down, *lora_flat):
        n_in = len(ring.plan.inputs)
        lora = MlpLora.unflatten(lora_flat, n_in)
        _, _, *needs = ctx.needs_input_grad  # after ring and x: gate, up, down, the adapters
        ring.base_trainable = any(needs[:3])
        need = MlpLora.unflatten(needs[3:], n_in)
        ring.lora_trainable = need.b_gate or need.b_up or need.a_down  # the travelling pieces
        weights = (gate, up, down)
        keep = not ring.options.recompute_mlp and any(ctx.needs_input_grad)
        y, hidden = tsp_mlp_forward(ring, x, weights, lora, keep_hidden=keep)
        ctx.ring, ctx.n_hidden = ring, len(hidden or ())
        x, norm_weight, ctx.norm = to_save(x)  # its norm's input when it is a norm's output
        ctx.save_for_backward(x, norm_weight, *weights, *lora_flat, *(hidden or ()))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, gate, up, down, *rest = ctx.saved_tensors
        n_in = len(ctx.ring.plan.inputs)
        lora, hidden = MlpLora.unflatten(rest[: n_in + 4], n_in), rest[n_in + 4 :] or None
        saved = (x, norm_weight, ctx.norm)
        weights = (gate, up, down)
        dx, base, d_lora = tsp_mlp_backward(ctx.ring, dy, saved, weights, lora=lora, hidden=hidden)
        return (None, dx, *(base or (None,) * 3), *d_lora.flatten())


def tsp_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    spec: MlpSpec,
    *,
    lora: LoraPlan | None = None,
    adapters: dict[str, torch.Tensor] | None = None,
):
    """Ring gated MLP of this rank's tokens: ``x [B, S/D, h]`` -> ``[B, S/D, h]`` with this
    rank's slices ``gate, up [f_p, h]`` and ``down [h, f_p]`` of the layer ``spec``.

    LoRA (``engine.adapters.lora``): ``lora`` names the adapted projections and ``adapters`` holds
    their pieces: the replicated A's ``a_gate, a_up [r, h]`` (their gradient is this rank's part:
    wrap them in ``comm.replicated``), this rank's B rows ``b_gate, b_up [f_p, r]``, down's A
    columns ``a_down [r, f_p]`` and down's replicated B ``b_down [h, r]`` (wrapped alike).
    """
    plan = lora or LoraPlan()
    ring = _RingSchedule(spec, x, (gate, up, down), plan)
    tensors = (x, gate, up, down, *MlpLora.of(adapters or {}, plan).flatten())
    return _TSPMLPFunction.apply(ring, *tensors)
