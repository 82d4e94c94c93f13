"""Full-width q/k RMS (OLMo-2): each local token's reciprocal RMS over *all* heads of its Q and K
projections, which no head group has alone.

OLMo-2 normalizes ``X·Wqᵀ`` over its whole width before splitting it into heads. Under TSP a rank
projects one head group at a time, so the per-token statistic is its own small schedule, run
before the attention:

    for r = 0..D-1:  W_r = broadcast(Wq_r, Wk_r, src=r)      # as the attention streams them
        ss_q += Σ (X_p·Wq_rᵀ)²;  ss_k += Σ (X_p·Wk_rᵀ)²       # each KV head counted once
    rq = rsqrt(ss_q / (n_h·d) + eps);  rk = rsqrt(ss_k / (n_kv·d) + eps)

The attention then normalizes each group's Q/K with ``rq, rk`` and its slice of the norm weight
(``qkv._full_norm``) and returns their gradients; the backward here streams the shards again and
turns ``drq, drk`` into ``dX`` and shard gradients, reduced to their owners (a shared KV head's
rows summed among its users, as the attention does). Saved: X_p and two floats per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.pointwise import add_matmul, matmul
from ..options import EngineOptions
from ..parallel import comm
from .head_groups import AttentionCall
from .heads import AttentionSpec
from .kv_exchange import share_kv


def _counted(t: torch.Tensor, spec: AttentionSpec, r: int) -> torch.Tensor:
    """Group ``r``'s K columns ``[..., n_kv(r)·d]`` with those of KV heads another group counts
    (a shared head's copy) zeroed."""
    heads, d = spec.counted_kv(r), spec.head_dim
    if heads.start == 0:
        return t
    t = t.clone()
    t[..., : heads.start * d] = 0
    return t


def _sums(call: AttentionCall, x: torch.Tensor, own: dict) -> tuple[torch.Tensor, torch.Tensor]:
    spec = call.spec
    ss_q = ss_k = 0
    for r, w in call.weight_stream(own):
        q = F.linear(x, w["wq"]).float()
        k = _counted(F.linear(x, w["wk"]).float(), spec, r)
        ss_q = ss_q + q.pow(2).sum(-1)
        ss_k = ss_k + k.pow(2).sum(-1)
    return ss_q, ss_k


def _rsqrt(ss: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    return torch.rsqrt(ss / n + eps)


class _QKRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: AttentionCall, x, wq, wk):
        spec = call.spec
        ss_q, ss_k = _sums(call, x, {"wq": wq, "wk": wk})
        d = spec.head_dim
        rq = _rsqrt(ss_q, spec.n_heads * d, spec.qk_norm_eps)
        rk = _rsqrt(ss_k, spec.n_kv_heads * d, spec.qk_norm_eps)
        ctx.call = call
        ctx.save_for_backward(x, wq, wk, rq, rk)
        return rq, rk

    @staticmethod
    def backward(ctx, d_rq, d_rk):
        x, wq, wk, rq, rk = ctx.saved_tensors
        call, spec = ctx.call, ctx.call.spec
        d, acc, p = spec.head_dim, call.acc, call.p
        # d(ss) of rsqrt(ss / n + eps); then d(X·Wᵀ) = 2 · d(ss) · (X·Wᵀ)
        dss_q = d_rq * (-0.5) * rq.pow(3) / (spec.n_heads * d)
        dss_k = d_rk * (-0.5) * rk.pow(3) / (spec.n_kv_heads * d)
        weights = ctx.needs_input_grad[2:4]
        B, T, h = x.shape
        x2 = x.reshape(B * T, h)
        dx = torch.zeros(B * T, h, dtype=acc, device=x.device)
        own = {"wq": wq, "wk": wk}
        mine = posted = None

        def collect():  # the previous group's reduction: it flew behind this group's GEMMs
            nonlocal mine
            r0, buf0, handle = posted
            handle.wait()
            if r0 == p:
                mine = comm.unpack(buf0, [wq.shape, wk.shape])

        for r, w in call.weight_stream(own):
            q = F.linear(x, w["wq"]).float()
            k = F.linear(x, w["wk"]).float()
            dq = (2 * dss_q[..., None] * q).to(x.dtype).reshape(B * T, -1)
            dk = _counted((2 * dss_k[..., None] * k).to(x.dtype), spec, r).reshape(B * T, -1)
            if any(weights):
                buf = comm.pack([matmul(dq.t(), x2, acc), matmul(dk.t(), x2, acc)], acc)
                handle = comm.reduce(buf, r, call.group, async_op=True)
                if posted is not None:
                    collect()
                posted = (r, buf, handle)
            add_matmul(dx, dq, w["wq"])  # while group r's gradient travels to its owner
            add_matmul(dx, dk, w["wk"])
        if posted is not None:
            collect()
        d_wq = d_wk = None
        if mine is not None:
            grads = {"wq": mine[0], "wk": mine[1]}
            share_kv(grads, spec, p, call.group)
            d_wq, d_wk = (grads[n].to(own[n].dtype) for n in ("wq", "wk"))
        return None, dx.view(B, T, h).to(x.dtype), d_wq, d_wk


def qk_rms(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    spec: AttentionSpec,
    group,
    options: EngineOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rq, rk)`` ``[B, T]`` (float32): each of this rank's tokens ``x [B, T, h]``'s reciprocal
    RMS over the whole Q and K projections, from this rank's head-group shards ``wq, wk``
    (differentiable: gradients reach ``x``, ``wq`` and ``wk``)."""
    call = AttentionCall(spec, group, options, x, gather_all=True)
    return _QKRms.apply(call, x, wq, wk)


def decode_qk_rms(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, group, p: int):
    """Inference: ``(rq, rk)`` of replicated tokens from this rank's group's pre-norm ``q [B, T,
    n_q·d]``, ``k [B, T, n_kv·d]`` (one all-reduce of the partial sums)."""
    ss = torch.stack([q.float().pow(2).sum(-1), _counted(k.float(), spec, p).pow(2).sum(-1)])
    comm.all_reduce(ss, group)
    d = spec.head_dim
    return (
        _rsqrt(ss[0], spec.n_heads * d, spec.qk_norm_eps),
        _rsqrt(ss[1], spec.n_kv_heads * d, spec.qk_norm_eps),
    )
