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

from dataclasses import dataclass

import torch

from .pointwise import add_matmul, matmul


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


# --- the attention schedule's adapters ---


class AttentionAdapters:
    """The attention schedule's LoRA hook (``engine.attention``; ``plan.inputs`` a subset of q/k/v,
    ``plan.output`` o's). The B rows ``lq, lk, lv [rows, r]`` of the adapted q/k/v travel with
    their head group's shards and add ``U · B_rᵀ`` to its projection (``U`` made once per pass
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
        ranks = [own[f"l{n}"].shape[1] for n in self.plan.inputs]
        a_scaled = self.a_stack.split(ranks) if ranks else ()
        for n, a in zip(self.plan.inputs, a_scaled):
            w = own[f"w{n}"]
            out[f"w{n}"] = torch.addmm(w, own[f"l{n}"].to(w.dtype), a.to(w.dtype))
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
            if n == "lo":
                out[n] = (own[n].shape[0], rows["o"])
            elif n[0] == "l":
                out[n] = (rows[n[1]], own[n].shape[1])
        return out

    def forward(self, x, lora_a, own, acc) -> AttentionAdaptersForward:
        """The adapters' state for a forward pass over the tokens ``x [B, T, h]``."""
        return AttentionAdaptersForward(self, x, lora_a, own, acc)

    def backward(self, dy2, x_p, lora_a, acc) -> AttentionAdaptersBackward:
        """The adapters' state for a backward pass given ``dY [B·T, h]`` (``x_p()``: the tokens
        ``[B·T, h]``, rebuilt when asked)."""
        return AttentionAdaptersBackward(self, dy2, x_p, lora_a, acc)


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
                self.du, x_p(), self.lora_a, hook.plan, hook.drop, dx
            )
            d_lora = [g.to(a.dtype) for g, a in zip(d_lora, self.lora_a)]
        if hook.b_out is not None:
            d_b_out = matmul(dy2.t(), self.z, self.acc).mul_(hook.plan.output)
            d_b_out = d_b_out.to(hook.b_out.dtype)
        return d_lora, d_b_out
