"""TSP attention: head-group weights travel by broadcast, K/V by sequence all-gather.

Rank p holds head group p (``n_heads/D`` query heads, the K/V heads they use, the matching
columns of o_proj) and the tokens of zigzag shard p. Forward, for r = 0..D-1:

    W_r = broadcast(Wq_r, Wk_r, Wv_r, Wo_r, src=r)        # prefetched while group r-1 computes
    Q, K, V = rope(X_p · W_r)                              # local tokens, global positions
    K_all, V_all = all_gather_seq(K, V)                    # only the real KV heads of group r
    A_r, lse_r = causal_attention(Q, K_all, V_all)         # by global position
    Y_p += A_r · Wo_rᵀ                                     # no all-reduce

Backward re-broadcasts W_r and re-gathers K/V (recomputed from the saved X_p), reduce-scatters
dK/dV and reduces dW_r to its owner r. Saved per rank: X_p, A_r and lse_r of every group, cos/sin
and the rank's own shards — O(S/D) activations, O(1/D) weights.

When D > n_kv_heads, each KV head is replicated on the D/n_kv ranks whose query heads use it;
its gradient is the sum over those groups, all-reduced so the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import TSPConfig
from . import comm
from .attention_kernels import (
    chunked_attention_backward,
    chunked_attention_forward,
    select_backend,
)
from .layout import ZigzagLayout
from .masked_attention import masked_chunked_attention
from .pointwise import rms_norm, rope

# Names of the sharded tensors of one head group, in broadcast order: the q/o part first, the
# k/v part last (so that shared KV heads can be reduced separately).
_QO = ("wq", "wo", "bq")
_KV = ("wk", "wv", "bk", "bv")
_Q = ("wq", "bq")  # the leaves of the q projection (its backward runs while dK/dV travel)


@dataclass(frozen=True)
class AttentionSpec:
    """Head layout of one attention layer on a TSP axis of size ``tsp_size``."""

    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    tsp_size: int
    scaling: float
    qk_norm_eps: float | None = None  # per-head RMSNorm on q and k (Qwen3), else None

    def __post_init__(self) -> None:
        D = self.tsp_size
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.n_heads % D:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by tsp_size={D}: choose a TSP size that "
                "divides the number of attention heads"
            )
        if self.n_kv_heads % D and D % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} and tsp_size={D}: one must divide the other so that "
                "every head group uses whole KV heads"
            )

    @property
    def heads_per_rank(self) -> int:
        return self.n_heads // self.tsp_size

    @property
    def kv_per_rank(self) -> int:
        return max(self.n_kv_heads // self.tsp_size, 1)

    @property
    def kv_replicas(self) -> int:
        """How many head groups share each KV head (1 unless D > n_kv_heads)."""
        return max(self.tsp_size // self.n_kv_heads, 1)

    def q_rows(self, p: int) -> slice:
        """Rows of q_proj (= columns of o_proj) owned by group ``p``."""
        n = self.heads_per_rank * self.head_dim
        return slice(p * n, (p + 1) * n)

    def kv_rows(self, p: int) -> slice:
        """Rows of k_proj / v_proj used by group ``p``."""
        first = p // self.kv_replicas * self.kv_per_rank
        return slice(first * self.head_dim, (first + self.kv_per_rank) * self.head_dim)


def project_qkv(x, w, cos, sin, q_norm, k_norm, spec: AttentionSpec):
    """Q ``[B, T, n_h/D, d]`` and K, V ``[B, T, kv/D, d]`` of the tokens ``x [B, T, h]`` for the
    head group whose shards are ``w`` (RoPE by ``cos, sin [B, T, d]``, then Qwen3 q/k norms)."""
    B, T, _ = x.shape
    d = spec.head_dim
    q = F.linear(x, w["wq"], w.get("bq")).view(B, T, -1, d)
    k = F.linear(x, w["wk"], w.get("bk")).view(B, T, -1, d)
    v = F.linear(x, w["wv"], w.get("bv")).view(B, T, -1, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, spec.qk_norm_eps)
        k = rms_norm(k, k_norm, spec.qk_norm_eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


class _Schedule:
    """One call's fixed context: group, layout, spec, options."""

    def __init__(self, spec: AttentionSpec, group, config: TSPConfig, x: torch.Tensor):
        self.spec, self.group, self.config = spec, group, config
        self.D, self.p = comm.size_and_rank(group)
        self.layout = ZigzagLayout.from_local(x.shape[1], self.D)
        self.q_spans = self.layout.spans(self.p)
        self.acc = config.accum_for(x.dtype)
        self.kernel = select_backend(config.attn_backend, x.device, x.dtype, config.attn_block)

    def weight_stream(self, own: dict[str, torch.Tensor]):
        """Yield ``(r, W_r)`` for r = 0..D-1; W_{r+1} is broadcast while the caller works on W_r."""
        names = list(own)
        shapes = [own[n].shape for n in names]
        numel = sum(s.numel() for s in shapes)
        ref = next(iter(own.values()))

        def post(r: int):
            buf = comm.pack([own[n] for n in names]) if r == self.p else ref.new_empty(numel)
            return buf, comm.broadcast(buf, r, self.group, async_op=True)

        nxt = post(0)
        for r in range(self.D):
            buf, handle = nxt
            handle.wait()
            if r + 1 < self.D:
                nxt = post(r + 1)
                if not self.config.overlap:
                    nxt[1].wait()
            yield r, dict(zip(names, comm.unpack(buf, shapes)))

    def project(self, x, w, cos, sin, q_norm, k_norm):
        """Local Q ``[B, T, n_h/D, d]`` and K, V ``[B, T, kv/D, d]`` of one head group."""
        return project_qkv(x, w, cos, sin, q_norm, k_norm, self.spec)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor):
        """Start the all-gather of one group's K/V: ``[B, T, hk, d]`` each ->
        ``(kv_all [D, B, T, 2hk, d], handle)``; ``kv_all`` is valid once ``handle.wait()``."""
        return comm.all_gather_seq(torch.cat([k, v], dim=2), self.group, async_op=True)

    def natural_kv(self, kv_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered ``kv_all [D, B, T, 2hk, d]`` (rank-major) -> K, V ``[B, S, hk, d]`` in token
        order (one copy: rank q's chunks q and 2D-1-q go to their global positions), stored
        heads-major (see ``heads_major``)."""
        D, B, T, two_hk, d = kv_all.shape
        kv = kv_all.new_empty(B, two_hk, D * T, d)
        for q in range(D):
            for s in self.layout.spans(q):
                kv[:, :, s.start : s.stop] = kv_all[q, :, s.offset : s.offset + s.length].transpose(
                    1, 2
                )
        return kv[:, : two_hk // 2].transpose(1, 2), kv[:, two_hk // 2 :].transpose(1, 2)

    def rank_major(self, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """Inverse of ``natural_kv`` for gradients: dK, dV ``[B, S, hk, d]`` -> ``[D, B, T, 2hk,
        d]`` in the accumulation dtype, ready to reduce-scatter."""
        B, S, hk, d = dk.shape
        out = dk.new_empty(self.D, B, S // self.D, 2 * hk, d, dtype=self.acc)
        for q in range(self.D):
            for s in self.layout.spans(q):
                rows = out[q, :, s.offset : s.offset + s.length]
                rows[:, :, :hk], rows[:, :, hk:] = dk[:, s.start : s.stop], dv[:, s.start : s.stop]
        return out


def heads_major(t: torch.Tensor) -> torch.Tensor:
    """The same ``[B, L, H, d]`` values stored as ``[B, H, L, d]`` (returned as a ``[B, L, H, d]``
    view): the fused kernels run up to 2x faster on that layout, GQA backward most of all."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def tsp_attention_forward(
    sched: _Schedule,
    x,
    cos,
    sin,
    own,
    q_norm,
    k_norm,
    keep: bool = True,
    kv_sink: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    key_valid: torch.Tensor | None = None,
):
    """Forward schedule. Returns ``Y_p [B, T, h]`` plus, if ``keep``, ``A [D, B, n_h/D, T, d]``
    and ``lse [D, B, n_h/D, T]`` (what backward needs), else None for both.

    Inference only (training passes neither): ``kv_sink(r, K_r, V_r)`` receives each group's
    all-gathered K/V ``[B, S, kv/D, d]`` in token order (a prefill keeps its own group's as its
    KV cache, no extra traffic); ``key_valid [B, S]`` (bool) hides padded keys (left padding),
    computed by ``masked_chunked_attention`` instead of the fused kernels."""
    B, T, _ = x.shape
    D, spec = sched.D, sched.spec
    y = x.new_zeros(B, T, spec.hidden_size, dtype=sched.acc)
    # A of every group, heads-major: [D, B, n_h/D, T, d]
    a_all = x.new_empty(D, B, spec.heads_per_rank, T, spec.head_dim) if keep else None
    lse_all = None
    for r, w in sched.weight_stream(own):
        q, k, v = sched.project(x, w, cos, sin, q_norm, k_norm)
        kv_all, gathering = sched.gather_kv(k, v)
        q = heads_major(q)
        gathering.wait()
        k_all, v_all = sched.natural_kv(kv_all)
        del kv_all
        if kv_sink is not None:
            kv_sink(r, k_all, v_all)
        if key_valid is None:
            a, lse = chunked_attention_forward(
                sched.kernel, q, sched.q_spans, k_all, v_all, spec.scaling
            )
        else:
            a, lse = masked_chunked_attention(
                q, sched.q_spans, k_all, v_all, key_valid, spec.scaling
            )
        if keep:
            if lse_all is None:
                lse_all = lse.new_empty(D, *lse.shape)
            a_all[r], lse_all[r] = a.transpose(1, 2), lse
        y += F.linear(a.flatten(2), w["wo"])
    return y.to(x.dtype), a_all, lse_all


def tsp_attention_backward(sched: _Schedule, dy, x, cos, sin, own, q_norm, k_norm, a_all, lse_all):
    """Backward schedule. Returns ``dX_p``, the fully reduced gradients of this rank's own shards
    (dict like ``own``) and this rank's partial gradients of the replicated q/k norm weights."""
    B, T, _ = x.shape
    D, p, spec, acc = sched.D, sched.p, sched.spec, sched.acc
    rep = spec.kv_replicas
    names = list(own)
    qo = [n for n in names if n in _QO]
    kvn = [n for n in names if n in _KV]
    dy = dy.contiguous()
    dx = torch.zeros(B, T, x.shape[-1], dtype=acc, device=x.device)
    d_norm = None
    d_own: dict[str, torch.Tensor] = {}
    pending: list[tuple[int, list[str], torch.Tensor, comm.Pending]] = []
    kv_acc = None

    def collect(keep: bool, keys: list[str], buf: torch.Tensor):
        if keep:
            d_own.update(zip(keys, comm.unpack(buf, [own[n].shape for n in keys])))

    for r, w in sched.weight_stream(own):
        with torch.enable_grad():
            xg = x.detach().requires_grad_()
            leaves = {n: w[n].detach().requires_grad_() for n in names if n != "wo"}
            norms = [t.detach().requires_grad_() for t in (q_norm, k_norm) if t is not None]
            q, k, v = sched.project(xg, leaves, cos, sin, *(norms or (None, None)))
        kv_all, gathering = sched.gather_kv(k.detach(), v.detach())
        # while K/V travel: dA = dY_p · Wo_r ;  dWo_r (partial) = dY_pᵀ · A_r
        a = a_all[r].transpose(1, 2)  # [B, T, n_h/D, d]
        da = heads_major((dy @ w["wo"]).view_as(a))
        dwo = dy.flatten(0, 1).t().to(acc) @ a.flatten(2).flatten(0, 1).to(acc)
        gathering.wait()
        k_all, v_all = sched.natural_kv(kv_all)
        del kv_all
        dq, dk_all, dv_all = chunked_attention_backward(
            sched.kernel,
            da,
            heads_major(q.detach()),
            sched.q_spans,
            k_all,
            v_all,
            a,
            lse_all[r],
            spec.scaling,
        )
        del k_all, v_all
        dkv, handle = comm.reduce_scatter_seq(sched.rank_major(dk_all, dv_all), sched.group, True)
        del dk_all, dv_all
        # while dK/dV travel: the q path (dX and the q weights' gradients)
        q_names = [n for n in leaves if n in _Q]
        kv_names = [n for n in leaves if n not in _Q]
        q_grads = torch.autograd.grad(q, [xg, *(leaves[n] for n in q_names), *norms[:1]], dq)
        handle.wait()
        dk, dv = dkv.to(k.dtype).split(k.shape[2], dim=2)
        kv_in = [xg, *(leaves[n] for n in kv_names), *norms[1:]]
        kv_grads = torch.autograd.grad((k, v), kv_in, (dk, dv))
        dx += q_grads[0] + kv_grads[0]
        g = {**dict(zip(q_names, q_grads[1:])), **dict(zip(kv_names, kv_grads[1:])), "wo": dwo}
        if norms:  # (d q_norm, d k_norm): the last gradient of each path
            gn = torch.stack([q_grads[-1].to(acc), kv_grads[-1].to(acc)])
            d_norm = gn if d_norm is None else d_norm + gn
        # reduce(dW_r, dst=r): the owner gets the sum over all ranks' tokens
        if rep == 1:
            buf = comm.pack([g[n] for n in names], acc)
            pending.append((r, names, buf, comm.reduce(buf, r, sched.group, async_op=True)))
        else:
            buf = comm.pack([g[n] for n in qo], acc)
            pending.append((r, qo, buf, comm.reduce(buf, r, sched.group, async_op=True)))
            part = comm.pack([g[n] for n in kvn], acc)
            kv_acc = part if kv_acc is None else kv_acc + part
            if (r + 1) % rep == 0:  # last group sharing this KV head: every copy gets the sum
                comm.all_reduce(kv_acc, sched.group)
                collect(r // rep == p // rep, kvn, kv_acc)
                kv_acc = None
        while len(pending) > 1 or (r == D - 1 and pending):
            r0, keys, buf0, h = pending.pop(0)
            h.wait()
            collect(r0 == p, keys, buf0)
    d_own = {n: d_own[n].to(own[n].dtype) for n in names}
    if d_norm is not None:
        d_norm = [t.to(n.dtype) for t, n in zip(d_norm, (q_norm, k_norm))]
    return dx.to(x.dtype), d_own, d_norm


class _TSPAttentionFunction(torch.autograd.Function):
    """Autograd boundary of the schedule: saves only local tensors, re-communicates in backward."""

    @staticmethod
    def forward(ctx, sched, names, x, cos, sin, q_norm, k_norm, *weights):
        own = dict(zip(names, weights))
        keep = any(ctx.needs_input_grad)
        y, a_all, lse_all = tsp_attention_forward(sched, x, cos, sin, own, q_norm, k_norm, keep)
        ctx.sched, ctx.names = sched, names
        if keep:
            ctx.save_for_backward(x, cos, sin, q_norm, k_norm, a_all, lse_all, *weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin, q_norm, k_norm, a_all, lse_all, *weights = ctx.saved_tensors
        own = dict(zip(ctx.names, weights))
        dx, d_own, d_norm = tsp_attention_backward(
            ctx.sched, dy, x, cos, sin, own, q_norm, k_norm, a_all, lse_all
        )
        d_qn, d_kn = d_norm if d_norm is not None else (None, None)
        return (None, None, dx, None, None, d_qn, d_kn, *(d_own[n] for n in ctx.names))


def tsp_attention(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: dict[str, torch.Tensor],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    spec: AttentionSpec,
    group,
    config: TSPConfig,
) -> torch.Tensor:
    """TSP attention of this rank's tokens: ``x [B, S/D, h]`` -> ``Y_p [B, S/D, h]`` (no o bias).

    ``cos, sin [B or 1, S/D, d]`` are the RoPE tables of the tokens' global positions; ``weights``
    holds this rank's head-group shards (``wq, wo, wk, wv`` and optional ``bq, bk, bv``);
    ``q_norm, k_norm`` the replicated per-head norm weights or None.
    """
    sched = _Schedule(spec, group, config, x)
    B, T, _ = x.shape
    if cos.shape[-2:] != (T, spec.head_dim) or cos.shape != sin.shape:
        raise ValueError(
            f"position_embeddings must be (cos, sin) of shape [B, {T}, {spec.head_dim}] "
            f"for this rank's tokens, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    cos, sin = cos.expand(B, T, -1), sin.expand(B, T, -1)
    return _TSPAttentionFunction.apply(
        sched, tuple(weights), x, cos, sin, q_norm, k_norm, *weights.values()
    )
