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

This module holds the maths; ``engine.adapters.hooks`` the schedules' hooks that apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.pointwise import add_matmul, matmul


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
