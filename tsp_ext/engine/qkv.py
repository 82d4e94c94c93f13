"""Q/K/V of one head group: one GEMM for ``wq | wk | wv``, Qwen3's q/k norms, RoPE, and the
hand-written adjoint (one GEMM for dX, one for dW, no autograd graph kept between the two).

Forward, for the local tokens ``X [B, T, h]`` and group r's shards::

    L = X · [Wq; Wk; Wv]ᵀ (+ b)            # [B, T, (n_q + 2 n_kv)·d]
    Q, K, V = split(L)                     # per head: [B, T, n, d]
    Q, K = rope(norm(Q)), rope(norm(K))    # norms only where the model has them

Backward: ``dL = [rope⁻ᵀ(dQ) | rope⁻ᵀ(dK) | dV]`` (through the norms where present),
``dW = dLᵀ · X``, ``db = Σ dL``, then the caller's ``dX += dL · W`` (after it has posted dW's
reduction, which then flies behind that GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .heads import AttentionSpec
from .pointwise import inv_rms, rms_norm, rms_norm_backward, rope, rope_backward

_W = ("wq", "wk", "wv")
_B = ("bq", "bk", "bv")


def stacked_weights(w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[Wq; Wk; Wv]`` ``[(n_q + 2 n_kv)·d, h]`` and the stacked biases (or None) of ``w``."""
    weight = torch.cat([w[n] for n in _W])
    bias = torch.cat([w[n] for n in _B]) if "bq" in w else None
    return weight, bias


def _split(t: torch.Tensor, w: dict[str, torch.Tensor], d: int) -> list[torch.Tensor]:
    """``[B, T, rows]`` -> its q, k, v column blocks, each viewed ``[B, T, n, d]``."""
    B, T, _ = t.shape
    sizes = [w[n].shape[0] for n in _W]
    return [part.view(B, T, -1, d) for part in t.split(sizes, dim=-1)]


def project_qkv(x, w, cos, sin, q_norm, k_norm, spec: AttentionSpec, weight=None):
    """Q ``[B, T, n_q, d]``, K, V ``[B, T, n_kv, d]`` and the pre-norm projection ``L [B, T,
    rows]`` of the tokens ``x [B, T, h]`` for the head group whose shards are ``w`` (RoPE by
    ``cos, sin [B, T, d]``). ``weight``: what ``stacked_weights(w)`` returned, if the caller has
    it. Not differentiable (see ``project_qkv_backward``). Q and K are stored heads-major: the
    kernels take Q so, and RoPE writes that layout ~3x faster than a token-major one; V is a
    view of L."""
    B, T, _ = x.shape
    W, b = weight if weight is not None else stacked_weights(w)
    lin = F.linear(x, W, b)
    q, k, v = _split(lin, w, spec.head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, spec.qk_norm_eps)
        k = rms_norm(k, k_norm, spec.qk_norm_eps)
    q_out, k_out = (x.new_empty(B, t.shape[2], T, spec.head_dim).transpose(1, 2) for t in (q, k))
    return rope(q, cos, sin, out=q_out), rope(k, cos, sin, out=k_out), v, lin


def project_qkv_backward(dq, dk, dv, x, w, weight, lin, cos, sin, q_norm, k_norm, spec, acc):
    """Adjoint of ``project_qkv`` given ``dq [B, T, n_q, d]``, ``dk, dv [B, T, n_kv, d]``: returns
    the gradients of the shards ``{wq, wk, wv[, bq, bk, bv]}`` (in ``acc``), of ``(q_norm,
    k_norm)`` (in ``acc``; None without norms) and ``dL [B·T, rows]``, the projection's gradient:
    the caller adds ``dX = dL · W`` (``add_matmul(dx, dL, W)``) once it has sent the weight
    gradients on. ``weight``: the forward's ``stacked_weights(w)``; ``lin``: its projection (read
    only with norms)."""
    B, T, h = x.shape
    d = spec.head_dim
    W, b = weight
    d_lin = x.new_empty(B, T, W.shape[0])
    dq_lin, dk_lin, dv_lin = _split(d_lin, w, d)
    dv_lin.copy_(dv)
    d_norms = None
    if q_norm is None:
        rope_backward(dq, cos, sin, out=dq_lin)
        rope_backward(dk, cos, sin, out=dk_lin)
    else:
        q_pre, k_pre, _ = _split(lin, w, d)
        d_norms = []
        for pre, g, nw, out in ((q_pre, dq, q_norm, dq_lin), (k_pre, dk, k_norm, dk_lin)):
            r = inv_rms(pre.float(), spec.qk_norm_eps)
            d_pre, d_w = rms_norm_backward(pre, nw, r, rope_backward(g, cos, sin))
            out.copy_(d_pre)
            d_norms.append(d_w.to(acc))
    d2, x2 = d_lin.view(-1, W.shape[0]), x.reshape(-1, h)
    sizes = [w[n].shape[0] for n in _W]
    grads = dict(zip(_W, (d2.t().to(acc) @ x2.to(acc)).split(sizes)))
    if b is not None:
        grads.update(zip(_B, d2.sum(0, dtype=acc).split(sizes)))
    return grads, d_norms, d2
