"""Local maths shared by the schedules and the modules: RMSNorm, rotary embeddings, and the
accumulating matmul."""

from __future__ import annotations

import torch


def add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` for 2-D views; in place when ``out`` has the operands' dtype (else the
    product is formed in theirs, e.g. bf16 operands into a float32 accumulator)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out += a @ b


def inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """The float32 reciprocal RMS ``[..., 1]`` of ``xf`` (``x.float()``) over its last dim."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32, as Hugging Face's Llama family does."""
    xf = x.float()
    return weight * (xf * inv_rms(xf, eps)).to(x.dtype)


def rms_norm_backward(x, weight, r, dy) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dweight)`` of ``rms_norm(x, weight)`` given ``dy`` and ``r =
    inv_rms(x.float())``: ``dx = r · (g - x̂ · mean(g ⊙ x̂))`` with ``g = dy ⊙ weight``, ``x̂ = x·r``
    (float32), in five fused passes. A float64 ``x`` (the parity tests' dtype) replays the taped
    norm's operations in order instead, so its gradients equal Hugging Face's to the bit."""
    xf = x.float()
    xn = xf * r
    dw = (dy * xn.to(x.dtype)).sum(tuple(range(dy.dim() - 1)))
    g = (dy * weight).float()
    if x.dtype == torch.float64:
        dr = (g * xf).sum(-1, keepdim=True)
        dmean = (-0.5 * dr) * r.pow(3) / x.shape[-1]  # rsqrt, then mean, backward
        dx = g * r + dmean * (2 * xf)  # the x·r product's and the square's paths
    else:
        dot = torch.linalg.vecdot(g, xn).unsqueeze(-1).div_(x.shape[-1])
        dx = torch.addcmul(g, xn, dot, value=-1).mul_(r)
    return dx.to(x.dtype), dw.to(weight.dtype)


class _RMSNormKeepingInput(torch.autograd.Function):
    """``rms_norm`` whose backward recomputes the normalised input: autograd keeps ``x`` and the
    float32 reciprocal RMS ``[..., 1]`` only, where the taped version also keeps ``x̂`` (and, for
    a half-precision ``x``, a float32 copy of it)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        r = inv_rms(xf, eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return *rms_norm_backward(*ctx.saved_tensors, dy), None


def rms_norm_keeping_input(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` (same values) for training: saves ``x`` and one float32 per row, and
    recomputes the normalised ``x`` in backward (one multiply)."""
    return _RMSNormKeepingInput.apply(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out=None) -> torch.Tensor:
    """Rotary embedding ``x·cos + rotate_half(x)·sin`` of ``x [B, T, H, d]`` with ``cos, sin
    [B, T, d]`` (Hugging Face's, halves written separately: no temporaries), into ``out`` (any
    strides) if given. Not differentiable: ``rope_backward`` is its adjoint."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    (x1, x2), (c1, c2), (s1, s2), (y1, y2) = (_halves(t) for t in (x, cos, sin, out))
    torch.mul(x1, c1, out=y1).addcmul_(x2, s1, value=-1)
    torch.mul(x2, c2, out=y2).addcmul_(x1, s2)
    return out


def rope_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out=None) -> torch.Tensor:
    """Adjoint of ``rope``: the gradient w.r.t. ``x`` of ``rope(x)`` given ``g [B, T, H, d]``."""
    out = torch.empty_like(g, memory_format=torch.contiguous_format) if out is None else out
    (g1, g2), (c1, c2), (s1, s2), (y1, y2) = (_halves(t) for t in (g, cos, sin, out))
    torch.mul(g1, c1, out=y1).addcmul_(g2, s2)
    torch.mul(g2, c2, out=y2).addcmul_(g1, s1, value=-1)
    return out


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of the last dim; ``[B, T, d]`` tables gain a head dim to broadcast."""
    if t.dim() == 3:
        t = t.unsqueeze(2)
    return t.chunk(2, dim=-1)
