"""gpt-oss's experts on the MoE schedules (``moe``): biased GEMMs and the clamped SwiGLU.

Hugging Face stores them as ``gate_up [E, h, 2F]`` with gate and up interleaved (gate = columns
``::2``, up = ``1::2``), ``gate_up_bias [E, 2F]``, ``down [E, F, h]`` and ``down_bias [E, h]``;
an expert computes ``FFN(x) = act(x·GU + b_gu)·Dn + b_dn`` with

    g, u = hid[:, ::2], hid[:, 1::2]
    g_c = min(g, limit),  u_c = clamp(u, -limit, limit)
    act = (u_c + 1) · g_c · σ(alpha · g_c)

A clamp passes no gradient where it clamps. The biases are per expert: they travel with their
expert's weights (the ring packs all four) and their gradients are per-expert row sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .moe import rows_mm, sum_mm


def _expert_of_rows(counts: list[int], device) -> torch.Tensor:
    """The group (expert) of each row ``[m]`` of rows laid out in groups of ``counts``."""
    sizes = torch.tensor(counts, device=device)
    return torch.repeat_interleave(torch.arange(len(counts), device=device), sizes)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert form (``ws = (gate_up [G, h, 2F], gate_up_bias [G, 2F], down [G, F, h],
    down_bias [G, h])``), the ``activation`` of ``moe.tsp_experts`` / ``decode_experts``:
    ``alpha`` and ``limit``, the model config's ``swiglu_alpha`` and ``swiglu_limit``."""

    alpha: float
    limit: float

    def _hidden(self, x, ws, counts, *, acc, ids) -> torch.Tensor:
        """``x·GU + b_gu`` ``[m, 2F]`` (acc), gate and up interleaved."""
        return rows_mm(x, ws[0], counts, acc).add_(ws[1].to(acc)[ids])

    def _gate(self, hid: torch.Tensor):
        """``act [m, F]`` of ``hid`` and what its backward needs: ``g_c``, ``u_c + 1``,
        ``σ(alpha · g_c)`` and the glu ``g_c · σ``."""
        g_c = hid[:, ::2].clamp(max=self.limit)
        up1 = hid[:, 1::2].clamp(-self.limit, self.limit).add_(1)
        s = torch.sigmoid(g_c * self.alpha)
        glu = g_c * s
        return up1 * glu, (g_c, up1, s, glu)

    def ffn(self, x, ws, counts: list[int], *, acc) -> torch.Tensor:
        """``FFN_g(x)`` ``[m, h]`` (acc) of rows ``x [m, h]`` in groups of ``counts``."""
        ids = _expert_of_rows(counts, x.device)
        act, _ = self._gate(self._hidden(x, ws, counts, acc=acc, ids=ids))
        return rows_mm(act, ws[2], counts, acc).add_(ws[3].to(acc)[ids])

    def ffn_backward(self, x, dy, w, ws, *, counts: list[int], acc, grads=None):
        """Backward of ``w · FFN(x)`` for rows ``x, dy [m, h]`` and routing weights ``w [m]``
        (acc): ``dX [m, h]`` and ``dw [m]`` (acc); adds the four weights' gradients into
        ``grads`` (as ``ws``, acc) if given."""
        ids = _expert_of_rows(counts, x.device)
        hid = self._hidden(x, ws, counts, acc=acc, ids=ids)
        act, (g_c, up1, s, glu) = self._gate(hid)
        d_out = rows_mm(dy, ws[2].transpose(1, 2), counts, acc)  # dY·Dnᵀ before the weight
        dyf = dy.to(acc)
        dw = (d_out * act).sum(dim=-1) + (dyf * ws[3].to(acc)[ids]).sum(dim=-1)
        dm = d_out.mul_(w[:, None])
        dh = torch.empty_like(hid)
        du = dm * glu
        dh[:, 1::2] = du.masked_fill_(hid[:, 1::2].abs() > self.limit, 0)
        dg = dm.mul_(up1).mul_(s + g_c * s * (1 - s) * self.alpha)
        dh[:, ::2] = dg.masked_fill_(hid[:, ::2] > self.limit, 0)
        if grads is not None:
            sum_mm(x.t(), dh, counts, grads[0])
            grads[1].index_add_(0, ids, dh)
            sum_mm(act.mul_(w[:, None]).t(), dyf, counts, grads[2])
            grads[3].index_add_(0, ids, dyf * w[:, None])
        return rows_mm(dh, ws[0].transpose(1, 2), counts, acc), dw
