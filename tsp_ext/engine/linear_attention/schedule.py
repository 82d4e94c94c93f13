"""Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention) on a TSP axis: head groups
folded, tokens sharded.

Head group r holds key heads ``split_range(n_k_heads, D, r)`` and their value heads: contiguous
rows of each input projection (``LinearAttentionSpec.projections``: the fused ``qkvz`` / ``ba``,
or ``q`` / ``k`` / ``v`` / ``z`` / ``b`` / ``a`` apart; ``hf.linear_attention`` maps them to
Hugging Face's modules) and columns of the output projection, which rank r broadcasts in turn.
Every rank projects its own tokens (zigzag chunks p and 2D-1-p), runs the causal depthwise conv
with a K-1 row halo (``state_exchange.halo``), computes per chunk its transition ``[C | M]`` and
outputs ``[o⁰ | R]`` in one pass (``v' = [v | 0]``, ``S_in' = [0 | I]``), all-gathers the
transitions, composes them in token order and adds ``R·S_in``; then the gated RMSNorm and its
share ``o_r · out_projᵣᵀ`` of the output (no all-reduce). Each group runs under activation
checkpointing: backward re-broadcasts the weights, and autograd saves only ``x`` and the small
per-layer tensors. Exact (float64 for float64, float32 otherwise, as Hugging Face's kernels).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.utils import checkpoint

from ..kernels.gated_delta import chunk_gated_delta, compute_dtype
from ..parallel import comm
from ..sharding.layout import RowSpans, ZigzagLayout
from ..sharding.partition import split_range
from .state_exchange import compose, exchange_states, halo


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Shapes of one Gated DeltaNet layer on a TSP axis of ``tsp_size`` ranks."""

    hidden: int
    n_k_heads: int
    n_v_heads: int
    dk: int
    dv: int
    conv: int
    eps: float
    tsp_size: int
    separate: bool = False  # one input projection per q, k, v, z, b, a (else qkvz and ba)

    def __post_init__(self) -> None:
        if not 1 <= self.tsp_size <= self.n_k_heads:
            raise ValueError(
                f"linear attention's {self.n_k_heads} key heads cannot be split over "
                f"tsp_size={self.tsp_size}: use tsp_size <= {self.n_k_heads}"
            )
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"{self.n_v_heads} value heads are not a multiple of the key heads")

    @property
    def ratio(self) -> int:
        """Value heads per key head."""
        return self.n_v_heads // self.n_k_heads

    def k_heads(self, r: int) -> slice:
        """Key heads of group r."""
        return split_range(self.n_k_heads, self.tsp_size, r)

    def v_heads(self, r: int) -> slice:
        """Value heads of group r."""
        k = self.k_heads(r)
        return slice(k.start * self.ratio, k.stop * self.ratio)

    def _rows(self, r: int, per_head: int) -> slice:
        k = self.k_heads(r)
        return slice(k.start * per_head, k.stop * per_head)

    def qkvz_rows(self, r: int) -> slice:
        """Rows of the fused ``qkvz`` projection (per key head ``[q | k | v·ratio | z·ratio]``)."""
        return self._rows(r, 2 * self.dk + 2 * self.ratio * self.dv)

    def ba_rows(self, r: int) -> slice:
        """Rows of the fused ``ba`` projection (per key head ``[b·ratio | a·ratio]``)."""
        return self._rows(r, 2 * self.ratio)

    def out_cols(self, r: int) -> slice:
        """Columns of the output projection (value channels of group r)."""
        return self._rows(r, self.ratio * self.dv)

    @property
    def projections(self) -> tuple[str, ...]:
        """The input projections of the layout, in the order ``project`` takes them: ``q``,
        ``k``, ``v``, ``z``, ``b``, ``a`` apart, or the fused ``qkvz`` and ``ba``."""
        if self.separate:
            return tuple("qkvzba")
        return ("qkvz", "ba")

    def rows(self, name: str, r: int) -> slice:
        """Group r's rows of input projection ``name`` (one of ``projections``)."""
        per_value_head = {"z": self.dv, "b": 1, "a": 1}
        if name == "qkvz":
            return self.qkvz_rows(r)
        if name == "ba":
            return self.ba_rows(r)
        if name in ("q", "k"):
            return self._rows(r, self.dk)
        if name == "v":
            return self.out_cols(r)
        return self._rows(r, self.ratio * per_value_head[name])

    def conv_channels(self, r: int) -> list[slice]:
        """Group r's q, k and v channel slices of the conv weight ``[C, 1, K]``."""
        q, key_dim = self._rows(r, self.dk), self.n_k_heads * self.dk
        v = self.out_cols(r)
        return [
            q,
            slice(q.start + key_dim, q.stop + key_dim),
            slice(v.start + 2 * key_dim, v.stop + 2 * key_dim),
        ]


@dataclass(frozen=True)
class Documents:
    """Where this rank's tokens' documents start: ``first [B or 1, T]`` (global index of each
    token's document start) and ``pos [T]`` (global positions)."""

    first: torch.Tensor
    pos: torch.Tensor

    @property
    def resets(self) -> torch.Tensor:
        """``[B or 1, T]`` bool: a document's first token."""
        return self.first == self.pos

    def lag_ok(self, K: int) -> torch.Tensor:
        """``[B or 1, T, K]`` bool: the conv tap at lag l stays in the token's document."""
        lags = torch.arange(K, device=self.pos.device)
        return (self.pos[None, :, None] - lags) >= self.first[:, :, None]


def documents(spans, layout: ZigzagLayout, p: int, device) -> Documents:
    """``Documents`` of rank ``p`` from its query spans (``Span`` tuple, ``RowSpans`` or None:
    one stream)."""
    pos = layout.positions(p, device)
    rows = spans.rows if isinstance(spans, RowSpans) else (spans or (),)
    first = torch.zeros(len(rows), layout.local_len, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        for s in row:
            first[b, s.offset : s.offset + s.length] = s.first_key
    return Documents(first, pos)


class _Broadcast(torch.autograd.Function):
    """forward: group ``src``'s shards, broadcast by rank src from its ``own`` (one buffer).
    backward: their gradients summed into rank src (reduce); other ranks' own get none."""

    @staticmethod
    def forward(ctx, src: int, shapes, group: ProcessGroup, *own: torch.Tensor):
        ctx.src, ctx.shapes, ctx.group = src, shapes, group
        if comm.size_and_rank(group)[1] == src:
            buf = comm.pack(own)
        else:
            buf = own[0].new_empty(sum(s.numel() for s in shapes))
        comm.broadcast(buf, src, group)
        return tuple(comm.unpack(buf, shapes))

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        grads = [ref.new_zeros(s) if g is None else g for g, s in zip(grads, ctx.shapes)]
        flat = comm.pack(grads)
        comm.reduce(flat, ctx.src, ctx.group)
        if comm.size_and_rank(ctx.group)[1] != ctx.src:
            return None, None, None, *(None for _ in grads)
        return None, None, None, *comm.unpack(flat, ctx.shapes)


def group_shapes(spec: LinearAttentionSpec, r: int) -> list[torch.Size]:
    """Shapes of group r's input projections' shards (``spec.projections``) and its output
    projection's columns."""
    rows = [spec.rows(name, r) for name in spec.projections]
    out = spec.out_cols(r)
    shapes = [torch.Size((s.stop - s.start, spec.hidden)) for s in rows]
    return [*shapes, torch.Size((spec.hidden, out.stop - out.start))]


def gated_rms(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``RMSNormGated`` (``RMS(o)·w·silu(z)``) in its op order, in the compute
    dtype (float32, or float64 for float64)."""
    dtype, acc = o.dtype, compute_dtype(o.dtype)
    h = o.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(dtype)
    return (h * F.silu(z.to(acc))).to(dtype)


def causal_conv(rows: torch.Tensor, left: torch.Tensor, w: torch.Tensor, ok: torch.Tensor):
    """Depthwise causal conv + SiLU of ``rows [N, T, C]`` after ``left [N, K-1, C]``, weights
    ``w [C, K]``; ``ok [N or 1, T, K]``: tap at lag l allowed. Sums in the compute dtype,
    rounds once (as a conv kernel)."""
    K, T, acc = w.shape[1], rows.shape[1], compute_dtype(rows.dtype)
    full = torch.cat([left, rows], dim=1).to(acc)
    out = 0
    for j in range(K):  # HF's conv1d: tap j reads lag K-1-j
        out = out + full[:, j : j + T] * w[:, j].to(acc) * ok[..., K - 1 - j, None].to(acc)
    return F.silu(out.to(rows.dtype))


def project(x: torch.Tensor, w_in: tuple[torch.Tensor, ...], spec, nk: int):
    """Group projections of ``x [B, T, h]`` by its input projections' shards ``w_in`` (in
    ``spec.projections`` order): ``(qkv rows [B, T, C_r], z [B, T, Hv_r, dv], b, a [B, T,
    Hv_r])``, the q | k | v rows as Hugging Face's conv takes them."""
    B, T, _ = x.shape
    if spec.separate:
        q, k, v, z, b, a = (F.linear(x, w) for w in w_in)
        return torch.cat([q, k, v], dim=-1), z.unflatten(-1, (-1, spec.dv)), b, a
    w_qkvz, w_ba = w_in
    m = spec.ratio * spec.dv
    q, k, v, z = F.linear(x, w_qkvz).view(B, T, nk, -1).split([spec.dk, spec.dk, m, m], dim=-1)
    b, a = F.linear(x, w_ba).view(B, T, nk, -1).split([spec.ratio, spec.ratio], dim=-1)
    qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    return qkv, z.reshape(B, T, -1, spec.dv), b.reshape(B, T, -1), a.reshape(B, T, -1)


def heads(mixed: torch.Tensor, b, a, *, A_log, dt_bias, spec, nk: int):
    """Post-conv rows -> the kernel's inputs ``q, k [.., Hv_r, dk]`` (l2-normed, q scaled,
    expanded), ``v``, ``g``, ``beta`` (``A_log, dt_bias [Hv_r]``: the group's)."""
    acc = compute_dtype(mixed.dtype)
    kd = nk * spec.dk
    q, k, v = mixed.split([kd, kd, mixed.shape[-1] - 2 * kd], dim=-1)
    q, k = (t.unflatten(-1, (nk, spec.dk)).to(acc) for t in (q, k))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * spec.dk**-0.5
    q, k = (t.repeat_interleave(spec.ratio, dim=-2) for t in (q, k))
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias)
    return q, k, v.unflatten(-1, (-1, spec.dv)), g, b.sigmoid()


Keep = Callable[[int, list[torch.Tensor], torch.Tensor], None]


@dataclass(frozen=True)
class GroupCall:
    """What every head group of one layer call shares: the layer ``spec``, the TSP ``group``,
    this rank's tokens' ``docs``, the prefill hook ``keep(r, states, qkv)`` (with the composed
    states and this rank's pre-conv rows; None in training) and ``identity [B, T]`` (bool:
    tokens whose transition is the identity, a prompt's padded tail; None: none)."""

    spec: LinearAttentionSpec
    group: ProcessGroup
    docs: Documents
    keep: Keep | None = None
    identity: torch.Tensor | None = None


class LayerWeights(NamedTuple):
    """One layer's tensors on this rank: ``own``, its rows of the input projections
    (``spec.projections``) then its output projection's columns; ``replicated``, the conv weight
    ``[C, 1, K]``, ``A_log``, ``dt_bias [Hv]`` and the norm's weight ``[dv]``."""

    own: tuple[torch.Tensor, ...]
    replicated: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def group_forward(r: int, call: GroupCall, x: torch.Tensor, weights: LayerWeights) -> torch.Tensor:
    """Head group r's share ``[B, T, h]`` of the output for this rank's tokens ``x [B, T, h]``
    (this rank's shards ``weights.own`` broadcast if r is this rank)."""
    spec, group, docs = call.spec, call.group, call.docs
    conv_w, A_log, dt_bias, norm_w = weights.replicated
    D, p = comm.size_and_rank(group)
    *w_in, w_out = _Broadcast.apply(r, group_shapes(spec, r), group, *weights.own)
    k_heads, v_heads = spec.k_heads(r), spec.v_heads(r)
    nk, B, T = k_heads.stop - k_heads.start, x.shape[0], x.shape[1]
    c = T // 2
    qkv, z, b, a = project(x, w_in, spec, nk)
    w = torch.cat([conv_w[ch, 0] for ch in spec.conv_channels(r)])  # [C_r, K]
    rows = qkv.unflatten(1, (2, c)).transpose(0, 1)  # [2, B, c, C_r]
    left = halo(rows, spec.conv - 1, group)
    ok = docs.lag_ok(spec.conv).unflatten(1, (2, c)).transpose(0, 1)  # [2, B or 1, c, K]
    mixed = torch.stack([causal_conv(rows[i], left[i], w, ok[i]) for i in range(2)])
    mixed = mixed.transpose(0, 1).flatten(1, 2)  # [B, T, C_r]
    q, k, v, g, beta = heads(
        mixed, b, a, A_log=A_log[v_heads], dt_bias=dt_bias[v_heads], spec=spec, nk=nk
    )
    identity = call.identity
    if identity is not None:
        g, beta = g.masked_fill(identity[..., None], 0), beta.masked_fill(identity[..., None], 0)
    # one pass per chunk: v' = [v | 0], S_in' = [0 | I] -> outputs [o0 | R], state [C | M]
    Hv, dk, dv = v.shape[2], spec.dk, spec.dv
    v1 = torch.cat([v, v.new_zeros(B, T, Hv, dk)], dim=-1)
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    s0 = torch.cat([q.new_zeros(dk, dv), eye], dim=-1).expand(2 * B, Hv, dk, dv + dk)

    def by_chunk(t):  # [B, T, ...] -> [2B, c, ...]
        return t.unflatten(1, (2, c)).transpose(0, 1).flatten(0, 1)

    resets = docs.resets.expand(B, T)
    o1, cm = chunk_gated_delta(*map(by_chunk, (q, k, v1, g, beta)), s0, by_chunk(resets))
    states = compose(exchange_states(cm.unflatten(0, (2, B)), group), dv)
    s_in = torch.stack([states[p], states[2 * D - 1 - p]]).flatten(0, 1)  # [2B, H, dk, dv]
    o = o1[..., :dv] + torch.einsum("nthk,nhkv->nthv", o1[..., dv:], s_in)
    o = o.unflatten(0, (2, B)).transpose(0, 1).flatten(1, 2).to(x.dtype)  # [B, T, Hv, dv]
    if call.keep is not None:
        call.keep(r, states, qkv)
    o = gated_rms(o, z, norm_w, spec.eps)
    return F.linear(o.flatten(2), w_out)


def tsp_gated_delta(x: torch.Tensor, weights: LayerWeights, call: GroupCall) -> torch.Tensor:
    """Training forward of one layer: ``x [B, S/D, h]`` (zigzag) with this rank's ``weights``
    (the replicated ones' gradients summed over the group by the caller's ``comm.replicated``).
    Returns ``[B, S/D, h]``; each head group recomputed in backward (its weights broadcast
    again)."""
    y = 0
    for r in range(call.spec.tsp_size):
        fn = functools.partial(group_forward, r, call)
        if torch.is_grad_enabled():
            with checkpoint.set_checkpoint_early_stop(False):
                y = y + checkpoint.checkpoint(fn, x, weights, use_reentrant=False)
        else:
            y = y + fn(x, weights)
    return y
