"""LoRA adapters inside the TSP schedules: the adapter pieces follow the fold of their base weight.

A LoRA projection is ``y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ`` (``A [r, in]``, ``B [out, r]``). Under TSP:

* **row-sharded** bases (q/k/v, gate/up: rank p holds rows of W) keep ``A`` replicated and ``B``
  sharded with W. ``U = s·drop(X_p)·Aᵀ [T, r]`` is the same for every head group / ring step, so it
  is made once per call (``input_projection``); ``B_r`` travels with ``W_r`` and each group or step
  adds ``U·B_rᵀ`` to its projection (one GEMM with the block-diagonal ``block_diagonal(B_q, B_k,
  B_v)``). Backward: ``dB_r = dLᵀ·U`` goes to r with ``dW_r``'s reduction; ``dU`` sums over the
  groups and gives ``dA`` (partial: summed over the TSP group by the caller) and ``dX``.
* **column-sharded** bases (o, down: rank p holds columns of W) shard ``A`` with W and keep ``B``
  replicated: ``A_r`` travels with ``W_r``, each group or step adds ``drop(act_r)·A_rᵀ`` into
  ``Z [T, r]``, and ``s·Z·Bᵀ`` joins the output. Backward: ``dZ = s·dY·B`` is known before the
  groups / steps, which rebuild ``Z`` on the way for ``dB = s·dYᵀ·Z``.

Without active dropout (p = 0, or evaluation) each shard is merged with its adapter by its owner
before it travels, ``W_p + s·B_p·A`` (q/k/v, gate/up) or ``W_p + s·B·A_p`` (o, down): a GEMM of
inner size r over the rank's own weights once per pass (an NF4-packed base is merged by every
receiver instead, after dequantizing), and the schedules then run as for a plain model (``dX``
through the merged weight includes the adapter's; the forward's MLP ring carries no adapter
pieces); ``U`` and ``Z`` are only rebuilt in backward, for the adapters' gradients. With dropout
the adapter input differs from the base's, so the terms are added separately as above.

Nothing of the adapters is saved for backward: ``U`` and ``Z`` are rebuilt, and dropout masks are
drawn again from a per-call seed and a key (projection, group, tile). A LoRA step saves exactly
what a full fine-tuning step saves.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import comm
from .pointwise import add_matmul, matmul, matmul_into
from .weight_ring import circulate


@dataclass(frozen=True)
class LoraPlan:
    """Which projections of one schedule carry an adapter (the tensors come with the call).

    Args:
        inputs: the row-sharded projections with an adapter, in the schedule's stacking order
            (attention: a subset of ``("q", "k", "v")``; MLP: of ``("gate", "up")``).
        scalings: ``s`` of each of ``inputs``.
        output: ``s`` of the column-sharded projection's (o / down) adapter, None without one.
        dropout: adapter dropout probability (PEFT's ``lora_dropout``, the same for all).
    """

    inputs: tuple[str, ...] = ()
    scalings: tuple[float, ...] = ()
    output: float | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.scalings):
            raise ValueError("LoraPlan needs one scaling per input projection")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")


class SeededDropout:
    """Inverted dropout whose masks are a function of ``(seed, key)``: the backward draws the
    forward's masks again instead of saving them. ``seed`` None: no dropout (eval, or p = 0)."""

    def __init__(self, p: float, seed: int | None) -> None:
        self.p, self.seed = p, seed

    @classmethod
    def for_call(cls, p: float) -> SeededDropout:
        """A fresh seed from torch's global generator when ``p > 0`` (a checkpointed layer's
        recompute, which restores that generator, draws the same)."""
        return cls(p, int(torch.randint(2**62, (1,)).item()) if p > 0 else None)

    @property
    def active(self) -> bool:
        return self.seed is not None

    def mask(self, key: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """The mask (0 or ``1/(1-p)``) of ``key``, shaped and typed like ``like``; None if off."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=like.device)
        gen.manual_seed(hash((self.seed, *key)) & (2**63 - 1))
        keep = torch.empty_like(like).bernoulli_(1 - self.p, generator=gen)
        return keep.div_(1 - self.p)

    def apply(self, t: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
        """``t`` with the mask of ``key`` applied (``t`` itself when off)."""
        mask = self.mask(key, t)
        return t if mask is None else t * mask


def block_diagonal(bs: list[torch.Tensor | None], rows: list[int]) -> torch.Tensor | None:
    """``[Σ rows, Σ r]`` with ``bs[j] [rows[j], r_j]`` on the diagonal (zero blocks elsewhere,
    and zero rows for a projection without an adapter, ``bs[j]`` None); None if all are None."""
    present = [b for b in bs if b is not None]
    if not present:
        return None
    out = present[0].new_zeros(sum(rows), sum(b.shape[1] for b in present))
    r0 = c0 = 0
    for b, n in zip(bs, rows):
        if b is not None:
            out[r0 : r0 + n, c0 : c0 + b.shape[1]] = b
            c0 += b.shape[1]
        r0 += n
    return out


def diagonal_blocks(full: torch.Tensor, present: list[bool], rows: list[int], ranks: list[int]):
    """Inverse of ``block_diagonal`` for a gradient ``[Σ rows, Σ r]``: the diagonal block of each
    present projection, in order (views)."""
    out, r0, c0 = [], 0, 0
    for has, n in zip(present, rows):
        if has:
            r = ranks[len(out)]
            out.append(full[r0 : r0 + n, c0 : c0 + r])
            c0 += r
        r0 += n
    return out


def scaled_stack(a: list[torch.Tensor], plan: LoraPlan) -> torch.Tensor:
    """``[s_j·A_j]_j`` ``[Σ r, h]``: the input adapters' A's, scaled, in stacking order."""
    return torch.cat([s * aj for s, aj in zip(plan.scalings, a)])


def input_projection(
    x2: torch.Tensor, a: list[torch.Tensor], plan: LoraPlan, drop: SeededDropout
) -> torch.Tensor:
    """``U = [s_j·drop_j(X)·A_jᵀ]_j`` ``[N, Σ r]`` of the tokens ``x2 [N, h]`` (in ``a``'s dtype:
    adapters may be kept wider than the base)."""
    dtype = a[0].dtype
    if not drop.active:
        return matmul(x2, scaled_stack(a, plan).t(), dtype)
    parts = [
        matmul(drop.apply(x2, (j,)), (s * aj).t(), dtype)
        for j, (s, aj) in enumerate(zip(plan.scalings, a))
    ]
    return torch.cat(parts, dim=1)


def input_projection_backward(
    du: torch.Tensor,
    x2: torch.Tensor,
    a: list[torch.Tensor],
    plan: LoraPlan,
    drop: SeededDropout,
    dx2: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Adjoint of ``input_projection``: adds ``dX`` into ``dx2 [N, h]`` (None: the merged
    weights carried it already) and returns this rank's partial ``dA_j [r_j, h]`` (in ``du``'s
    dtype; the caller sums them over the TSP group)."""
    grads, c0 = [], 0
    for j, (s, aj) in enumerate(zip(plan.scalings, a)):
        du_j = du[:, c0 : c0 + aj.shape[0]]
        c0 += aj.shape[0]
        mask = drop.mask((j,), x2)
        xin = x2 if mask is None else x2 * mask
        grads.append(matmul(du_j.t(), xin, du.dtype).mul_(s))
        if dx2 is None:
            continue
        if mask is None:
            add_matmul(dx2, du_j, s * aj)
        else:
            dx2 += matmul(du_j, s * aj, dx2.dtype).mul_(mask)
    return grads


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
    """The MLP ring's LoRA hook for one pass (forward or backward; ``engine.mlp``).

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
                self.du, self.x2, a_in, self.plan, self.drop, dx_adapter
            )
            d_a_in = tuple(g.to(a.dtype) for g, a in zip(grads, a_in))
        d_b_down = None
        if lora.b_down is not None:
            d_b_down = matmul(dy2.t(), self.z, self.acc).mul_(self.plan.output)
            d_b_down = d_b_down.to(lora.b_down.dtype)
        return MlpLora(d_a_in, *d_b, d_a_out, d_b_down)
