"""Q/K/V of one head group: one GEMM for ``wq | wk | wv``, Qwen3's q/k norms, RoPE, and the
hand-written adjoint (one GEMM for dX, one for dW, no autograd graph kept between the two).

Forward, for the local tokens ``X [B, T, h]`` and group r's shards::

    L = X · [Wq; Wk; Wv]ᵀ (+ b)            # [B, T, (n_q + 2 n_kv)·d]
    Q, K, V = split(L)                     # per head: [B, T, n, d]
    Q, K = rope(norm(Q)), rope(norm(K))    # norms only where the model has them

A full-width q/k norm (OLMo-2: one RMS over all heads of a token's projection, which no head
group has alone) takes each token's reciprocal RMS ``rq, rk [B, T]`` from
``engine.attention.qk_rms`` and the group's slice of the norm weight: ``norm(Q) = w_r · (Q · rq)``;
the backward returns the gradient of ``rq, rk`` too (``qk_rms`` carries it back to X and the
weights).

With LoRA adapters on some of q/k/v (``engine.adapters.lora``) ``L += U · B_rᵀ``, ``U`` the
adapters' input projection and ``B_r`` their group-r rows, block-diagonal.

Backward: ``dL = [rope⁻ᵀ(dQ) | rope⁻ᵀ(dK) | dV]`` (through the norms where present),
``dW = dLᵀ · X`` and ``db = Σ dL`` (for trainable bases only), ``dB_r = dLᵀ · U``, then the
caller's ``dX += dL · W`` and ``dU += dL · B_r`` (after it has posted the weight gradients'
reduction, which then flies behind those GEMMs).

The stacked weight holds each q/k head's rows *interleaved*: Hugging Face's rotation pairs
dimension i with i + d/2, and with the pair made adjacent RoPE is one complex multiply
(``pointwise.rope``) instead of four strided half-width passes. Attention only takes dot products
of Q with K over d, so Q and K permuted alike give the same scores and outputs; the q/k weight
(and bias, and q/k-norm weight) gradients are permuted back, so nothing outside this module
sees the order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..adapters.lora import block_diagonal, diagonal_blocks
from ..kernels.pointwise import (
    TokenRows,
    add_matmul,
    inv_rms,
    matmul,
    rms_norm,
    rms_norm_backward,
    rope,
)
from .heads import QKV_BIASES, QKV_LORA, QKV_WEIGHTS, ROTATED_SHARDS, AttentionSpec


class QKNorms(NamedTuple):
    """The q/k norm weights a head group uses (per head, or its slices of full-width ones:
    ``spec.qk_norm_full``, with the tokens' reciprocal RMS ``rms = (rq, rk)`` ``[B, T]`` from
    ``engine.attention.qk_rms``); all None without norms."""

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    rms: tuple[torch.Tensor, torch.Tensor] | None = None


class Tokens(NamedTuple):
    """The tokens a projection reads, ``x [B, T, h]`` (a tensor or ``TokenRows``), and their
    RoPE ``phases [B, T, 1, d/2]`` (``pointwise.rope_phases``; in backward their conjugate,
    RoPE's adjoint: the opposite rotation)."""

    x: torch.Tensor | TokenRows
    phases: torch.Tensor


class GroupProjection(NamedTuple):
    """What projects one head group's tokens: its shards ``w`` (``wq, wk, wv``, biases, LoRA B
    rows ``lq, lk, lv``), their ``stacked_weights`` (None: made from ``w``), its q/k ``norms``
    and ``u [B·T, Σ r]``, the LoRA input projection (``lora.input_projection``) when ``w`` holds
    adapter rows not merged into W (else None)."""

    w: dict[str, torch.Tensor]
    weight: tuple | None = None
    norms: QKNorms = QKNorms()
    u: torch.Tensor | None = None


def _pair_order(d: int, rot: int) -> torch.Tensor:
    """Per head, the source dim of each interleaved position: the rotated pairs (i, i + rot/2) at
    2i, 2i + 1, then the dims ``rot..d-1`` RoPE leaves alone (partial rotary)."""
    pairs = torch.arange(rot).view(2, rot // 2).t().reshape(-1)
    return torch.cat([pairs, torch.arange(rot, d)])


def interleave_heads(t: torch.Tensor, d: int, rot: int | None = None) -> torch.Tensor:
    """Rows ``[n·d, ...]`` of n heads -> per head, rows ``0, rot/2, 1, rot/2 + 1, ...`` then
    ``rot..d-1`` (``rot``: the rotated dims, default d; a copy)."""
    if rot is None or rot == d:
        return t.reshape(-1, 2, d // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    heads = t.reshape(-1, d, *t.shape[1:])
    return heads[:, _pair_order(d, rot).to(t.device)].reshape(t.shape)


def deinterleave_heads(t: torch.Tensor, d: int, rot: int | None = None) -> torch.Tensor:
    """Inverse of ``interleave_heads`` (a copy)."""
    if rot is None or rot == d:
        return t.reshape(-1, d // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    heads = t.reshape(-1, d, *t.shape[1:])
    return heads[:, torch.argsort(_pair_order(d, rot)).to(t.device)].reshape(t.shape)


def stacked_weights(
    w: dict[str, torch.Tensor], d: int, merge: torch.Tensor | None = None, rot: int | None = None
):
    """``(W, b, B)``: ``[Wq; Wk; Wv]`` ``[(n_q + 2 n_kv)·d, h]`` with the q/k heads' rows
    interleaved (``interleave_heads``), the stacked biases alike (or None) and the LoRA B rows of
    ``w`` (``lq, lk, lv``, those present) alike, block-diagonal ``[rows, Σ r]`` (or None).
    ``merge``: the adapters' scaled A's ``[Σ r, h]`` (``lora.scaled_stack``): W is then
    ``W + B · merge``, the adapted projection (``engine.adapters.lora``). ``rot``: the rotated dims
    of each head (partial rotary; default all)."""

    def interleaved(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        return interleave_heads(t, d, rot) if t is not None and name in ROTATED_SHARDS else t

    def stack(names):
        return torch.cat([interleaved(n, w[n]) for n in names])

    rows = [w[n].shape[0] for n in QKV_WEIGHTS]
    lora = block_diagonal([interleaved(n, w.get(n)) for n in QKV_LORA], rows)
    weight = stack(QKV_WEIGHTS)
    if merge is not None and lora is not None:
        add_matmul(weight, lora, merge)
    return weight, stack(QKV_BIASES) if QKV_BIASES[0] in w else None, lora


def _split(t: torch.Tensor, w: dict[str, torch.Tensor], d: int) -> list[torch.Tensor]:
    """``[B, T, rows]`` -> its q, k, v column blocks, each viewed ``[B, T, n, d]``."""
    B, T, _ = t.shape
    sizes = [w[n].shape[0] for n in QKV_WEIGHTS]
    return [part.view(B, T, -1, d) for part in t.split(sizes, dim=-1)]


def _full_norm(t: torch.Tensor, weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``weight · (t · r)`` of a group's ``t [B, T, n, d]`` (interleaved heads) with its slice
    ``weight [n·d]`` of a full-width norm and the tokens' reciprocal RMS ``r [B, T]`` (float32),
    as Hugging Face's RMSNorm computes it."""
    w = interleave_heads(weight, t.shape[-1]).view(t.shape[-2:])
    return w * (t.float() * r[..., None, None]).to(t.dtype)


def _full_norm_backward(pre, weight, r, g):
    """``(d_pre, d_weight [n·d], d_r [B, T])`` of ``_full_norm(pre, weight, r)`` given ``g``."""
    d = pre.shape[-1]
    w = interleave_heads(weight, d).view(pre.shape[-2:])
    xn = pre.float() * r[..., None, None]
    gw = (g * w).float()
    d_w = (g * xn.to(g.dtype)).sum((0, 1)).reshape(-1)
    d_r = (gw * pre.float()).sum((-1, -2))
    return (gw * r[..., None, None]).to(pre.dtype), deinterleave_heads(d_w, d), d_r


def project_qkv(tokens: Tokens, group: GroupProjection, spec: AttentionSpec):
    """Q ``[B, T, n_q, d]``, ``KV [B, 2 n_kv, T, d]`` (K's heads, then V's) and the pre-norm
    projection ``L [B, T, rows]`` of the ``tokens`` (``x [B, T, h]``, RoPE by their phases) for
    the head ``group`` (``GroupProjection``; with ``spec.qk_norm_full`` its norms are its slices
    of the full-width weights and the tokens' ``rms``). Not differentiable (see
    ``project_qkv_backward``). Q and K come with each head's dimensions interleaved (module
    docstring). Everything is heads-major: the kernels take Q so, ``KV`` is the K/V all-gather's
    send buffer (its chunks then land in token order by contiguous block copies), and RoPE
    writes that layout faster than a token-major one. ``split_kv`` views K and V ``[B, T, n_kv,
    d]``."""
    x, phases = TokenRows.of(tokens.x), tokens.phases
    w, (q_norm, k_norm, rms), u = group.w, group.norms, group.u
    B, T, _ = x.shape
    d = spec.head_dim
    weight = group.weight if group.weight is not None else stacked_weights(w, d, rot=spec.rotary)
    W, b, lora = weight
    lin = x.linear(W, b)
    if lora is not None and u is not None:
        add_matmul(lin.view(-1, lin.shape[-1]), u, lora.t())
    q, k, v = _split(lin, w, d)
    if q_norm is not None and spec.qk_norm_full:
        q, k = _full_norm(q, q_norm, rms[0]), _full_norm(k, k_norm, rms[1])
    elif q_norm is not None:
        eps, offset = spec.qk_norm_eps, spec.qk_norm_offset
        q = rms_norm(q, interleave_heads(q_norm, d, spec.rotary), eps, offset)
        k = rms_norm(k, interleave_heads(k_norm, d, spec.rotary), eps, offset)
    n_kv = k.shape[2]
    q_out = lin.new_empty(B, q.shape[2], T, d).transpose(1, 2)
    kv = lin.new_empty(B, 2 * n_kv, T, d)
    k_out, v_out = split_kv(kv)
    rope(k, phases, out=k_out)
    v_out.copy_(v)
    return rope(q, phases, out=q_out), kv, lin


def split_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-major ``KV [B, 2 n_kv, L, d]`` -> K, V as ``[B, L, n_kv, d]`` views."""
    k, v = kv.chunk(2, dim=1)
    return k.transpose(1, 2), v.transpose(1, 2)


def project_qkv_backward(
    dq: torch.Tensor,
    dkv: torch.Tensor,
    tokens: Tokens,
    group: GroupProjection,
    lin: torch.Tensor | None,
    spec: AttentionSpec,
    acc: torch.dtype,
    trainable: frozenset[str],
):
    """Adjoint of ``project_qkv`` given ``dq [B, T, n_q, d]`` and ``dkv [B, 2 n_kv, T, d]``
    (heads-major, as ``project_qkv`` returned them): returns the gradients of the shards in
    ``trainable`` (of ``wq, wk, wv, bq, bk, bv, lq, lk, lv``; in ``acc``: no weight-gradient GEMM
    for a frozen base), of the q/k norm weights (in ``acc``; None without norms) and ``dL [B·T,
    rows]``, the projection's gradient: the caller adds ``dX = dL · W`` (``add_matmul(dx, dL,
    W)``) and ``dU = dL · B`` once it has sent the weight gradients on. ``tokens``: the
    forward's ``x`` and the conjugate of its phases (RoPE's adjoint is the opposite rotation);
    ``group``: the forward's, its ``weight`` the ``stacked_weights`` of its shards and ``u`` the
    LoRA input projection; ``lin``: the forward's projection (read only with norms). ``dq, dkv``
    and ``dL`` are in the interleaved order, the returned weight and norm gradients in the
    shards' own. With full-width norms the norm gradients are of the group's slices, followed
    by those of ``rq, rk`` ``[B, T]``."""
    x, inverse = TokenRows.of(tokens.x), tokens.phases
    w, (q_norm, k_norm, rms), u = group.w, group.norms, group.u
    dk, dv = split_kv(dkv)
    B, T, h = x.shape
    d = spec.head_dim
    W, b, lora = group.weight
    d_lin = dq.new_empty(B, T, W.shape[0])
    dq_lin, dk_lin, dv_lin = _split(d_lin, w, d)
    dv_lin.copy_(dv)
    d_norms = None
    if q_norm is None:
        rope(dq, inverse, out=dq_lin)
        rope(dk, inverse, out=dk_lin)
    elif spec.qk_norm_full:
        q_pre, k_pre, _ = _split(lin, w, d)
        d_norms, d_rms = [], []
        for pre, g, nw, r, out in (
            (q_pre, dq, q_norm, rms[0], dq_lin),
            (k_pre, dk, k_norm, rms[1], dk_lin),
        ):
            d_pre, d_w, d_r = _full_norm_backward(pre, nw, r, rope(g, inverse))
            out.copy_(d_pre)
            d_norms.append(d_w.to(acc))
            d_rms.append(d_r)
        d_norms += d_rms
    else:
        q_pre, k_pre, _ = _split(lin, w, d)
        d_norms = []
        for pre, g, nw, out in ((q_pre, dq, q_norm, dq_lin), (k_pre, dk, k_norm, dk_lin)):
            r = inv_rms(pre.float(), spec.qk_norm_eps)
            nw = interleave_heads(nw, d, spec.rotary)
            d_pre, d_w = rms_norm_backward(pre, nw, r, rope(g, inverse), offset=spec.qk_norm_offset)
            out.copy_(d_pre)
            d_norms.append(deinterleave_heads(d_w.to(acc), d, spec.rotary))
    d2 = d_lin.view(-1, W.shape[0])
    sizes = [w[n].shape[0] for n in QKV_WEIGHTS]
    grads = {}
    if not trainable.isdisjoint(QKV_WEIGHTS):
        grads.update(zip(QKV_WEIGHTS, x.grad_weight(d2, acc).split(sizes)))
    if b is not None and not trainable.isdisjoint(QKV_BIASES):
        grads.update(zip(QKV_BIASES, d2.sum(0, dtype=acc).split(sizes)))
    if lora is not None:
        present = [n in w for n in QKV_LORA]
        ranks = [w[n].shape[1] for n in QKV_LORA if n in w]
        blocks = diagonal_blocks(matmul(d2.t(), u, acc), present, sizes, ranks)
        grads.update(zip([n for n in QKV_LORA if n in w], blocks))
    for n in grads:
        if n in ROTATED_SHARDS:
            grads[n] = deinterleave_heads(grads[n], d, spec.rotary)
    return grads, d_norms, d2
