"""The schedules' LoRA hooks: what the attention schedule (``AttentionAdapters``) and the MLP ring
(``MlpRingAdapters``) call at fixed points of each head group or ring step, so that the schedules
read as the algorithm and the adapters live in one place (the maths: ``engine.adapters.lora``).

Each hook holds one pass's merge policy (without active dropout the owner merges its adapters into
its shards before they travel; an NF4-packed base is merged by every receiver), the adapter pieces
that travel with the shards, and the pass's ``U`` / ``Z`` (rebuilt in backward, never saved).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from ..attention.heads import SHARDS, ShardKind, shard_name
from ..kernels.pointwise import add_matmul, matmul, matmul_into
from ..parallel import comm
from ..parallel.weight_ring import circulate
from .lora import (
    LoraPlan,
    SeededDropout,
    block_diagonal,
    diagonal_blocks,
    input_projection,
    input_projection_backward,
    scaled_stack,
)

# --- the attention schedule's adapters ---


class AttentionAdapters:
    """The attention schedule's LoRA hook (``engine.attention.schedule``; ``plan.inputs`` a subset
    of q/k/v, ``plan.output`` o's). The B rows ``lq, lk, lv [rows, r]`` of the adapted q/k/v travel
    with their head group's shards and add ``U · B_rᵀ`` to its projection (``U`` made once per pass
    from the replicated A's); o's A columns ``lo [r, n_q·d]`` travel too and add ``drop(A_r) ·
    Ao_rᵀ`` into ``Z [B·T, r]``, which the replicated ``B_o`` maps into the output. Frozen base
    shards still travel but get no gradient GEMMs and no reduction (the schedule's ``trainable``).

    Per call: ``begin`` (dropout, whether merged). The schedule then asks for the shards as their
    owner sends them (``travelling``) and as a receiver uses them (``qkv_merge``, ``out_weight``),
    the adapter pieces' sizes (``shapes``), and per pass for the state that adds the adapters'
    terms: ``forward`` (``AttentionAdaptersForward``), ``backward``
    (``AttentionAdaptersBackward``); nothing of it outlives its pass."""

    def __init__(self, plan: LoraPlan | None = None) -> None:
        self.plan = plan or LoraPlan()
        self.drop = SeededDropout(self.plan.dropout, None)
        self.merged = False  # adapters merged into the travelling shards
        self.premerged = False  # ... by their owner, before they travel
        self.a_stack = self.b_out = None

    def begin(self, drop: SeededDropout, lora_a: list, b_out, packed: bool) -> None:
        """This call's dropout, o's replicated B ``b_out`` and whether the adapters are merged
        into each group's shards (without active dropout): by each shard's owner before it
        travels (``travelling``), or, when the base travels NF4-``packed``, by every receiver."""
        self.drop, self.b_out = drop, b_out
        self.merged = not drop.active
        self.premerged = self.merged and not packed
        if self.merged and lora_a:
            self.a_stack = scaled_stack(lora_a, self.plan)

    def travelling(self, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards as they travel: with ``premerged`` adapters, ``W + B·(s·A)`` for
        the adapted q/k/v and ``Wo + s·B_o·Ao`` for o (new tensors; once per pass here instead
        of once per group on every rank), else ``own`` itself."""
        if not self.premerged:
            return own
        out = dict(own)
        weights = [shard_name(ShardKind.WEIGHT, n) for n in self.plan.inputs]
        loras = [shard_name(ShardKind.LORA, n) for n in self.plan.inputs]
        ranks = [own[n].shape[1] for n in loras]
        a_scaled = self.a_stack.split(ranks) if ranks else ()
        for n, lora, a in zip(weights, loras, a_scaled):
            w = own[n]
            out[n] = torch.addmm(w, own[lora].to(w.dtype), a.to(w.dtype))
        if "lo" in own:
            out["wo"] = self._merged_out(own)
        return out

    def _merged_out(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        wo, s = w["wo"], self.plan.output
        return torch.addmm(wo, self.b_out.to(wo.dtype), w["lo"].to(wo.dtype), alpha=s)

    @property
    def qkv_merge(self) -> torch.Tensor | None:
        """What a receiver merges the q/k/v adapters of a group with (``merge`` of
        ``qkv.stacked_weights``): the scaled A's when merged and not by their owner, else None."""
        return self.a_stack if self.merged and not self.premerged else None

    def out_weight(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Group's o shard, merged with o's adapter (``Wo_r + s·B_o·Ao_r``) if so (and not done
        by its owner)."""
        if not self.merged or self.premerged or "lo" not in w:
            return w["wo"]
        return self._merged_out(w)

    @staticmethod
    def shapes(own: dict[str, torch.Tensor], names, rows: dict[str, int]) -> dict[str, tuple]:
        """Sizes of the adapter pieces among ``names`` for a group whose q/k/v/o widths are
        ``rows`` (their ranks: those of this rank's own pieces)."""
        out = {}
        for n in names:
            kind, projection = SHARDS[n]
            if n == "lo":
                out[n] = (own[n].shape[0], rows[projection])
            elif kind is ShardKind.LORA:
                out[n] = (rows[projection], own[n].shape[1])
        return out

    def forward(self, x, lora_a, own, acc) -> AttentionAdaptersForward:
        """The adapters' state for a forward pass over the tokens ``x [B, T, h]``."""
        return AttentionAdaptersForward(self, x, lora_a, own, acc=acc)

    def backward(self, dy2, x_p, lora_a, acc) -> AttentionAdaptersBackward:
        """The adapters' state for a backward pass given ``dY [B·T, h]`` (``x_p()``: the tokens
        ``[B·T, h]``, rebuilt when asked)."""
        return AttentionAdaptersBackward(self, dy2, x_p, lora_a, acc=acc)


class AttentionAdaptersForward:
    """One forward pass's adapter terms apart from the base's (not merged): ``u``, the input
    projection ``U`` for every group's Q/K/V, and ``Z``, which each group's A adds to."""

    def __init__(self, hook: AttentionAdapters, x, lora_a, own, acc) -> None:
        self.hook = hook
        self.u = self.z = None
        if not hook.merged:
            n = x.shape[0] * x.shape[1]
            if lora_a:
                self.u = input_projection(x.reshape(n, -1), lora_a, hook.plan, hook.drop)
            if "lo" in own:
                self.z = x.new_zeros(n, own["lo"].shape[0], dtype=acc)

    def add_group(self, r: int, a: torch.Tensor, w: dict[str, torch.Tensor]) -> None:
        """``Z += drop(A_r) · Ao_rᵀ`` of group ``r``'s attention output ``a [B, T, n_q, d]``."""
        if self.z is not None:
            a2 = a.reshape(-1, w["lo"].shape[1])
            add_matmul(self.z, self.hook.drop.apply(a2, (3, r)), w["lo"].t())

    def add_output(self, y2: torch.Tensor) -> None:
        """``Y += s · Z · B_oᵀ`` into ``y2 [B·T, h]``, once every group added to ``Z``."""
        if self.z is not None:
            add_matmul(y2, self.z, (self.hook.plan.output * self.hook.b_out).t())


class AttentionAdaptersBackward:
    """One backward pass's adapter state: ``dZ = s·dY·B_o`` (known before the groups) and ``Z``
    rebuilt group by group for ``dB_o``; ``U`` rebuilt from X_p (not saved) and ``dU`` summed
    over the groups for the A's gradients."""

    def __init__(self, hook: AttentionAdapters, dy2, x_p, lora_a, acc) -> None:
        self.hook, self.lora_a, self.acc = hook, lora_a, acc
        self.u = self.du = self.dz = self.z = None
        if hook.b_out is not None:
            self.dz = matmul(dy2, hook.plan.output * hook.b_out, acc)
            self.z = torch.zeros_like(self.dz)
        if lora_a:
            self.u = input_projection(x_p(), lora_a, hook.plan, hook.drop)
            self.du = torch.zeros_like(self.u, dtype=acc)

    @property
    def u_term(self) -> torch.Tensor | None:
        """``U`` for the recomputed projection: None when merged (W has the adapter)."""
        return None if self.hook.merged else self.u

    def output_backward(self, r: int, lo, a: torch.Tensor, da: torch.Tensor):
        """Group ``r``'s ``Z += drop(A)·Ao_rᵀ`` backward, from the heads-major ``a [B, n_q, T,
        d]``: ``da [B, n_q, T, d] += drop⁻(dZ · Ao_r)`` (unless merged: the merged ``Wo``'s
        ``dA`` has it), adds the group's term into ``Z`` and returns ``dAo_r = dZᵀ · drop(A)`` in
        ``acc`` (None without o's adapter)."""
        if self.dz is None:
            return None
        B, nq, T, d = a.shape
        rank = lo.shape[0]
        mask = self.hook.drop.mask((3, r), self.dz.new_empty(B * T, nq * d, dtype=a.dtype))
        a_in = a.transpose(1, 2).reshape(B * T, nq * d)  # token-major copy: the adapter's input
        if mask is not None:
            a_in.mul_(mask)
        if not self.hook.merged:
            ao_heads = lo.to(da.dtype).view(rank, nq, d).transpose(0, 1)  # [n_q, r, d]
            d_in = torch.matmul(self.dz.view(B, T, rank).to(da.dtype).unsqueeze(1), ao_heads)
            if mask is not None:
                d_in.mul_(mask.view(B, T, nq, d).transpose(1, 2))
            da += d_in
        d_ao = matmul(self.dz.t(), a_in, self.acc)
        add_matmul(self.z, a_in, lo.t())
        return d_ao

    def projection_backward(self, d_lin: torch.Tensor, lora: torch.Tensor | None) -> None:
        """``dU += dL · B_r`` of a group's projection gradient ``d_lin [B·T, rows]`` (``lora``:
        its block-diagonal B rows, ``qkv.stacked_weights``)."""
        if lora is not None:
            add_matmul(self.du, d_lin, lora)

    def finish(self, dx2: torch.Tensor, dy2: torch.Tensor, x_p):
        """``(dA's, dB_o)``: this rank's partial gradients of the replicated A's (None without)
        and of o's B (None without), after every group; adds the A's share of dX into ``dx2``
        (unless merged: dX through the merged weights has it)."""
        hook, d_lora, d_b_out = self.hook, None, None
        if self.du is not None:
            dx = None if hook.merged else dx2
            d_lora = input_projection_backward(
                self.du, x_p(), self.lora_a, hook.plan, drop=hook.drop, dx2=dx
            )
            d_lora = [g.to(a.dtype) for g, a in zip(d_lora, self.lora_a)]
        if hook.b_out is not None:
            d_b_out = matmul(dy2.t(), self.z, self.acc).mul_(hook.plan.output)
            d_b_out = d_b_out.to(hook.b_out.dtype)
        return d_lora, d_b_out


# --- the MLP ring's adapters ---


class MlpLora(NamedTuple):
    """The gated MLP's adapter tensors, or their gradients (entries None without that adapter):
    the replicated A's of ``LoraPlan.inputs`` ``[r_j, h]``, this rank's B rows of gate and up
    ``[f_p, r]``, down's A columns ``[r_d, f_p]`` and down's replicated B ``[h, r_d]``."""

    a_in: tuple = ()
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    a_down: torch.Tensor | None = None
    b_down: torch.Tensor | None = None

    @classmethod
    def of(cls, pieces: dict[str, torch.Tensor], plan: LoraPlan) -> MlpLora:
        """From ``tsp_mlp``'s ``adapters`` (``a_gate``, ``a_up``, ``b_gate``, ``b_up``,
        ``a_down``, ``b_down``)."""
        a_in = tuple(pieces[f"a_{n}"] for n in plan.inputs)
        return cls(a_in, *(pieces.get(n) for n in ("b_gate", "b_up", "a_down", "b_down")))

    def flatten(self) -> tuple:
        """The entries in one tuple, ``a_in``'s spread out (an autograd Function's inputs)."""
        return (*self.a_in, self.b_gate, self.b_up, self.a_down, self.b_down)

    @classmethod
    def unflatten(cls, items, n_in: int) -> MlpLora:
        """Inverse of ``flatten`` for ``n_in`` input A's."""
        return cls(tuple(items[:n_in]), *items[n_in:])


class MlpStepAdapters(NamedTuple):
    """The adapter pieces that travel the ring with one owner's shard of width ``f``, or their
    gradients: gate/up's B rows, block-diagonal ``[2f, Σ r]``, and down's A columns ``[r_d,
    f]`` (None without)."""

    b_in: torch.Tensor | None = None
    a_out: torch.Tensor | None = None


class MlpAdapterTile(NamedTuple):
    """One tile of one ring step: its token ``rows``, the step's adapter pieces and down
    adapter's dropout mask ``[n, f]`` (None without dropout or without a down adapter)."""

    rows: slice
    step: MlpStepAdapters
    mask: torch.Tensor | None


class MlpRingAdapters:
    """The MLP ring's LoRA hook for one pass (forward or backward; ``engine.feed_forward.mlp``).

    Gate/up's B rows (block-diagonal ``[2 f_q, r_g + r_u]``) and down's A columns ``[r_d, f_q]``
    ride a second ring beside the base shards (``circulate``; they may be kept in a wider
    dtype). Without active dropout they are merged into the shards (``merge``: by the owner,
    ``premerged``, or on arrival) and add no terms; otherwise ``U·Bᵀ`` joins the pre-activations
    (``add_input``; ``U`` made once per pass from the replicated A's: ``start_forward``),
    ``drop(act)·Aᵀ`` joins ``Z`` (``add_output``) and ``s·Z·B_downᵀ`` the output
    (``finish_forward``). Backward: ``start_backward`` (``U``, ``dZ = s·dY·B_down``), per
    tile ``add_d_act``, ``add_grads`` (rebuilding ``Z``) and ``add_d_input`` (``dU``), then
    ``finish_backward``. The gradient ring carries the B rows' and A columns' gradients
    (``grad_views``) when ``trainable``."""

    def __init__(
        self,
        plan: LoraPlan,
        drop: SeededDropout,
        lora: MlpLora,
        f_p: int,
        acc: torch.dtype,
        trainable: bool,
        packed: bool,
    ) -> None:
        self.plan, self.drop, self.lora, self.acc, self.trainable = plan, drop, lora, acc, trainable
        b_in = block_diagonal([lora.b_gate, lora.b_up], [f_p, f_p])
        self.own = MlpStepAdapters(b_in, lora.a_down)  # this rank's pieces, as they travel
        self.r_in = self.own.b_in.shape[1] if self.own.b_in is not None else 0
        self.r_out = lora.a_down.shape[0] if lora.a_down is not None else 0
        self.merged = not drop.active
        # merged by each shard's owner before it travels (once per pass, not once per step on
        # every rank), unless the base travels NF4-``packed``: then by every receiver
        self.premerged = self.merged and not packed and self.active
        self.a_stack = scaled_stack(list(lora.a_in), plan) if self.merged and lora.a_in else None
        self.x2 = self.u = self.du = self.z = self.dz = None

    @property
    def active(self) -> bool:
        """Whether any adapter pieces travel the ring."""
        return self.r_in + self.r_out > 0

    def numel(self, f: int) -> int:
        """Elements of the pieces of a width-``f`` shard."""
        return 2 * f * self.r_in + self.r_out * f

    def views(self, buf: torch.Tensor, f: int) -> MlpStepAdapters:
        """The pieces of a width-``f`` shard in the flat ``buf`` (views)."""
        b_in = buf[: 2 * f * self.r_in].view(2 * f, self.r_in) if self.r_in else None
        a_out = buf[2 * f * self.r_in : self.numel(f)].view(self.r_out, f) if self.r_out else None
        return MlpStepAdapters(b_in, a_out)

    def circulate(self, ring, sizes: list[int], overlap: bool, backward: bool):
        """Iterator of the pieces of owner ``p - t`` at each step t of the ring (``sizes``: every
        owner's width), arriving while the caller works; Nones when they do not travel (none,
        or ``premerged`` and not ``backward``, where they are read)."""
        if not self.active or (self.premerged and not backward):
            return itertools.repeat(MlpStepAdapters())
        own = comm.pack([t for t in self.own if t is not None], numel=self.numel(max(sizes)))
        steps = circulate(ring, own, overlap, reuse=True)
        return (self.views(cur, sizes[(ring.rank - t) % ring.size]) for t, cur in steps)

    def merge(self, gu, dn, step: MlpStepAdapters, in_place: bool = False):
        """``[G; U] + B_in·a_stack`` and ``Dn + s·B_down·A_out`` (each unchanged without its
        adapter): new tensors (the ring buffers travel on), or, ``in_place``, over ``gu`` and
        ``dn`` (the owner's copy, before it travels)."""
        if step.b_in is not None:
            b_in, a = step.b_in.to(gu.dtype), self.a_stack.to(gu.dtype)
            gu = (gu.addmm_ if in_place else gu.addmm)(b_in, a)
        if step.a_out is not None:
            b_out, a_out = self.lora.b_down.to(dn.dtype), step.a_out.to(dn.dtype)
            dn = (dn.addmm_ if in_place else dn.addmm)(b_out, a_out, alpha=self.plan.output)
        return gu, dn

    def on_arrival(self, gu, dn, step: MlpStepAdapters):
        """What a step computes with: ``merge`` of a received shard, unless ``premerged``."""
        return self.merge(gu, dn, step) if self.merged and not self.premerged else (gu, dn)

    def grad_numel(self, f: int) -> int:
        """Gradient-ring elements of the pieces of a width-``f`` shard."""
        return self.numel(f) if self.trainable else 0

    def grad_views(self, flat: torch.Tensor, f: int) -> MlpStepAdapters:
        """The pieces' gradients in a gradient-ring buffer (after the base's), or Nones."""
        return self.views(flat, f) if self.trainable else MlpStepAdapters()

    def tile(self, rows: slice, q: int, f: int, step: MlpStepAdapters) -> MlpAdapterTile:
        """The tile ``rows`` of the step with owner ``q``'s width-``f`` shard."""
        mask = None
        if self.z is not None:
            like = self.x2.new_empty(rows.stop - rows.start, f)
            mask = self.drop.mask((2, q, rows.start), like)
        return MlpAdapterTile(rows, step, mask)

    def add_input(self, hid: torch.Tensor, rows: slice, step: MlpStepAdapters) -> None:
        """Adds ``U·B_inᵀ`` of ``rows`` to their pre-activations ``hid [n, 2f]`` (not merged)."""
        if self.u is not None and not self.merged:
            add_matmul(hid, self.u[rows], step.b_in.t())

    def add_output(self, act: torch.Tensor, tile: MlpAdapterTile) -> torch.Tensor | None:
        """Adds ``drop(act)·A_outᵀ`` of the tile's ``act [n, f]`` into ``Z``; returns
        ``drop(act)`` (None without a down adapter term)."""
        if self.z is None:
            return None
        dropped = act if tile.mask is None else act * tile.mask
        add_matmul(self.z[tile.rows], dropped, tile.step.a_out.t())
        return dropped

    def start_forward(self, x2: torch.Tensor) -> None:
        """``U`` and a zero ``Z`` for the tokens ``x2 [N, h]`` (not merged; else nothing)."""
        self.x2 = x2
        if not self.merged:
            a_in = list(self.lora.a_in)
            self.u = input_projection(x2, a_in, self.plan, self.drop) if a_in else None
            self.z = x2.new_zeros(x2.shape[0], self.r_out, dtype=self.acc) if self.r_out else None

    def finish_forward(self, y2: torch.Tensor) -> None:
        """Adds ``s·Z·B_downᵀ`` into the output ``y2 [N, h]``."""
        if self.z is not None:
            add_matmul(y2, self.z, (self.plan.output * self.lora.b_down).t())

    def start_backward(self, x2: torch.Tensor, dy2: torch.Tensor) -> None:
        """``U`` and a zero ``dU`` of the tokens ``x2 [N, h]``, and ``dZ = s·dY·B_down`` (which
        needs only ``dY``) and a zero ``Z``, rebuilt tile by tile for ``B_down``'s gradient."""
        self.x2 = x2
        if self.lora.a_in:
            self.u = input_projection(x2, list(self.lora.a_in), self.plan, self.drop)
            self.du = torch.zeros_like(self.u, dtype=self.acc)
        if self.lora.b_down is not None:
            self.dz = matmul(dy2, self.plan.output * self.lora.b_down, self.acc)
            self.z = torch.zeros_like(self.dz)

    def add_d_act(self, dm: torch.Tensor, tile: MlpAdapterTile) -> None:
        """Adds down adapter's share ``drop(dZ·A_out)`` to the tile's ``d(act) [n, f]``."""
        if self.dz is not None and not self.merged:
            d_act = matmul(self.dz[tile.rows], tile.step.a_out, dm.dtype)
            dm.add_(d_act if tile.mask is None else d_act.mul_(tile.mask))

    def add_grads(self, out: MlpStepAdapters, dh, act, tile: MlpAdapterTile, add: bool) -> None:
        """Writes (``add``: adds) the tile's share of the pieces' gradients into ``out`` from
        ``dH [n, 2f]`` and ``act [n, f]``, and rebuilds the tile's ``Z``."""
        if out.b_in is not None:
            matmul_into(out.b_in, dh.t(), self.u[tile.rows], add)
        dropped = self.add_output(act, tile)
        if out.a_out is not None and dropped is not None:
            matmul_into(out.a_out, self.dz[tile.rows].t(), dropped, add)

    def add_d_input(self, dh: torch.Tensor, tile: MlpAdapterTile) -> None:
        """Adds ``dH·B_in`` into the tile's rows of ``dU``."""
        if tile.step.b_in is not None:
            add_matmul(self.du[tile.rows], dh, tile.step.b_in)

    def finish_backward(self, own: MlpStepAdapters, dy2, dx2) -> MlpLora:
        """The adapters' gradients from ``own`` (the gradient ring's, for this rank's pieces),
        ``dU`` (adding the input adapters' ``dX`` into ``dx2`` when not merged) and ``Z``; the
        replicated A's and ``B_down``'s are this rank's partials."""
        lora, d_b = self.lora, [None, None]
        if own.b_in is not None:
            bs, f = (lora.b_gate, lora.b_up), own.b_in.shape[0] // 2
            ranks = [b.shape[1] for b in bs if b is not None]
            blocks = iter(diagonal_blocks(own.b_in, [b is not None for b in bs], [f, f], ranks))
            d_b = [next(blocks).to(b.dtype) if b is not None else None for b in bs]
        d_a_out = own.a_out.to(lora.a_down.dtype) if own.a_out is not None else None
        d_a_in = ()
        if self.du is not None:
            a_in, dx_adapter = list(lora.a_in), None if self.merged else dx2  # merged: in dX
            grads = input_projection_backward(
                self.du, self.x2, a_in, plan=self.plan, drop=self.drop, dx2=dx_adapter
            )
            d_a_in = tuple(g.to(a.dtype) for g, a in zip(grads, a_in))
        d_b_down = None
        if lora.b_down is not None:
            d_b_down = matmul(dy2.t(), self.z, self.acc).mul_(self.plan.output)
            d_b_down = d_b_down.to(lora.b_down.dtype)
        return MlpLora(d_a_in, *d_b, d_a_out, d_b_down)
