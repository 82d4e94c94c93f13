"""TSP attention: head-group weights travel by broadcast, K/V by sequence all-gather.

Rank p holds head group p (``⌊n_heads/D⌋`` or ``⌈n_heads/D⌉`` consecutive query heads, the K/V
heads they use, the matching columns of o_proj; ``engine.heads``) and the tokens of zigzag
shard p. Forward, for r = 0..D-1:

    W_r = broadcast(Wq_r, Wk_r, Wv_r, Wo_r, src=r)        # prefetched two groups ahead
    Q, K, V = rope(X_p · [Wq_r; Wk_r; Wv_r]ᵀ)              # local tokens, global positions
    K_all, V_all = all_gather_seq(K, V)                    # only the real KV heads of group r
    A_r, lse_r = causal_attention(Q, K_all, V_all)         # by global position
    Y_p += A_r · Wo_rᵀ                                     # no all-reduce

With ``overlap``, group r+1 is projected and its K/V gather posted before group r attends, so
the gather flies while the attention kernel runs (forward and the backward's recompute alike).

Backward re-broadcasts W_r and re-gathers K/V (recomputed from the saved X_p), reduce-scatters
dK/dV and reduces dW_r to its owner r. Saved per rank: X_p (as its RMSNorm's input, which the
norm keeps anyway, when it is one: ``pointwise.to_save``), A_r and lse_r of every group, cos/sin
and the rank's own shards — O(S/D) activations, O(1/D) weights.

LoRA adapters (``engine.lora``): B rows of q/k/v travel with their group's shards and add
``U · B_rᵀ`` to its projection (``U`` made once per call from the replicated A's); o's A columns
travel too and add ``A_r · Ao_rᵀ`` into ``Z [B, T, r]``, which the replicated ``B_o`` maps into
the output. Frozen base shards still travel but get no gradient GEMMs and no reduction.

A KV head used by several groups (D > n_kv_heads, or a group boundary inside a KV head's query
heads) is replicated on those ranks; its gradient is the sum over all of its users, summed among
those ranks only (point to point) so the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import comm, nf4
from .attention_backends import select_backend
from .chunked_attention import chunked_attention_backward, chunked_attention_forward
from .heads import AttentionSpec
from .layout import RowSpans, Span, ZigzagLayout
from .lora import (
    LoraPlan,
    SeededDropout,
    input_projection,
    input_projection_backward,
    scaled_stack,
)
from .masked_attention import masked_chunked_attention
from .options import EngineOptions
from .pointwise import add_matmul, from_saved, matmul, rope_phases, to_save
from .qkv import project_qkv, project_qkv_backward, split_kv, stacked_weights
from .window import WindowExchange

# Names of the k/v part of one head group's shards (summed among the users of a shared KV head).
_KV = ("wk", "wv", "bk", "bv", "lk", "lv")


class _Schedule:
    """One call's fixed context: group, layout, query spans (default: the zigzag chunks; packed
    documents: ``engine.documents.query_spans``), spec, options, LoRA plan, the shards that
    get gradients (``trainable``, set by the autograd function) and how K/V travel: the
    all-gather, or under a sliding window the ``WindowExchange`` of the keys each rank's queries
    see (unless ``options.window_exchange`` is off or ``gather_all``: a prefill keeps every key
    of its group as its KV cache)."""

    def __init__(
        self,
        spec: AttentionSpec,
        group,
        options: EngineOptions,
        x: torch.Tensor,
        q_spans=None,
        lora: LoraPlan | None = None,
        gather_all: bool = False,
    ):
        self.spec, self.group, self.options = spec, group, options
        self.lora = lora or LoraPlan()
        self.drop = SeededDropout(self.lora.dropout, None)
        self.trainable: frozenset[str] = frozenset()
        self.merged = False  # adapters merged into the travelling shards (``set_adapters``)
        self.premerged = False  # ... by their owner, before they travel
        self.a_stack = self.b_out = None
        self.D, self.p = comm.size_and_rank(group)
        self.layout = ZigzagLayout.from_local(x.shape[1], self.D)
        stream = self.layout.spans(self.p)
        self.q_spans = stream if q_spans is None else q_spans
        windowed = spec.window if options.window_exchange and not gather_all else None
        self.exchange = WindowExchange.for_layout(self.layout, windowed)
        self.acc = options.accum_for(x.dtype)
        self.dtype = x.dtype  # what NF4-packed shards (QLoRA's base) are dequantized to
        # packed documents and inference prefill change the kernels' shapes from call to call
        repeating = self.q_spans == stream and torch.is_grad_enabled()
        self.kernel = select_backend(
            options.attn_backend, x.device, x.dtype, options.attn_block, spec.head_dim, repeating
        )

    def set_adapters(self, drop: SeededDropout, lora_a: list, b_out, packed: bool) -> None:
        """This call's dropout and whether the adapters are merged into each group's shards
        (without active dropout: ``engine.lora``): by each shard's owner before it travels
        (``merged_own``), or, when the base travels NF4-``packed``, by every receiver."""
        self.drop, self.b_out = drop, b_out
        self.merged = not drop.active
        self.premerged = self.merged and not packed
        if self.merged and lora_a:
            self.a_stack = scaled_stack(lora_a, self.lora)

    def merged_own(self, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards as they travel: with ``premerged`` adapters, ``W + B·(s·A)`` for
        the adapted q/k/v and ``Wo + s·B_o·Ao`` for o (new tensors; once per pass here instead
        of once per group on every rank), else ``own`` itself."""
        if not self.premerged:
            return own
        out = dict(own)
        ranks = [own[f"l{n}"].shape[1] for n in self.lora.inputs]
        a_scaled = self.a_stack.split(ranks) if ranks else ()
        for n, a in zip(self.lora.inputs, a_scaled):
            w = own[f"w{n}"]
            out[f"w{n}"] = torch.addmm(w, own[f"l{n}"].to(w.dtype), a.to(w.dtype))
        if "lo" in own:
            wo = own["wo"]
            out["wo"] = torch.addmm(
                wo, self.b_out.to(wo.dtype), own["lo"].to(wo.dtype), alpha=self.lora.output
            )
        return out

    def stacked(self, w: dict[str, torch.Tensor]):
        """``stacked_weights`` of group shards ``w``, merged with the q/k/v adapters if so (and
        not done by their owner)."""
        late = self.merged and not self.premerged
        return stacked_weights(w, self.spec.head_dim, self.a_stack if late else None)

    def out_weight(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Group's o shard, merged with o's adapter (``Wo_r + s·B_o·Ao_r``) if so (and not done
        by its owner)."""
        if not self.merged or self.premerged or "lo" not in w:
            return w["wo"]
        wo = w["wo"]
        return torch.addmm(
            wo, self.b_out.to(wo.dtype), w["lo"].to(wo.dtype), alpha=self.lora.output
        )

    def shapes(self, r: int, own: dict[str, torch.Tensor], names) -> list[torch.Size]:
        """Shapes of group ``r``'s shards ``names`` (every rank computes them from the spec and
        its own shards' LoRA ranks)."""
        h = self.spec.hidden_size
        nq = self.spec.n_q(r) * self.spec.head_dim
        nk = self.spec.n_kv(r) * self.spec.head_dim
        rows = {"q": nq, "k": nk, "v": nk}
        shapes = {"wo": (h, nq)}
        if "lo" in own:
            shapes["lo"] = (own["lo"].shape[0], nq)
        for n in names:
            if n[0] == "w" and n != "wo":
                shapes[n] = (rows[n[1]], h)
            elif n[0] == "b":
                shapes[n] = (rows[n[1]],)
            elif n != "lo" and n[0] == "l":
                shapes[n] = (rows[n[1]], own[n].shape[1])
        return [torch.Size(shapes[n]) for n in names]

    def weight_stream(self, own: dict[str, torch.Tensor]):
        """Yield ``(r, W_r)`` for r = 0..D-1; W_{r+1} is broadcast while the caller works on W_r.
        Each broadcast carries group r's own sizes (groups differ by at most one head); shards of
        different dtypes (adapters kept wider than a half-precision base, NF4-packed bytes) travel
        in one buffer per dtype; packed ones are dequantized on arrival."""
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n, t in own.items():
            by_dtype.setdefault(t.dtype, []).append(n)
        parts = list(by_dtype.values())
        packed = [n for n, t in own.items() if t.dtype == torch.uint8]

        def sent(r: int, names: list[str]) -> list[torch.Size]:
            real = self.shapes(r, own, names)
            return [
                torch.Size([nf4.packed_bytes(s)]) if n in packed else s for n, s in zip(names, real)
            ]

        shapes = [[sent(r, names) for names in parts] for r in range(self.D)]

        def post(r: int):
            posted = []
            sending = self.merged_own(own) if r == self.p else None
            for names, shape in zip(parts, shapes[r]):
                if sending is not None:
                    buf = comm.pack([sending[n] for n in names])
                else:
                    buf = own[names[0]].new_empty(sum(s.numel() for s in shape))
                posted.append((buf, comm.broadcast(buf, r, self.group, async_op=True)))
            return posted

        def wait(posted) -> None:
            for _, handle in posted:
                handle.wait()

        nxt = post(0)
        for r in range(self.D):
            cur = nxt
            wait(cur)
            if r + 1 < self.D:
                nxt = post(r + 1)
                if not self.options.overlap:
                    wait(nxt)
            w = {}
            for names, shape, (buf, _) in zip(parts, shapes[r], cur):
                w.update(zip(names, comm.unpack(buf, shape)))
            for n, s in zip(packed, self.shapes(r, own, packed)):
                w[n] = nf4.unpack(w[n], s, self.dtype)
            yield r, w

    def projected_groups(self, own: dict[str, torch.Tensor], project: Callable):
        """Yield ``_Group``s r = 0..D-1: W_r, ``project(r, W_r)`` (a tuple starting ``q, k, v``) and
        the K/V all-gather of group r in flight. With ``overlap``, group r+1 is projected and its
        gather posted before group r is yielded, so the caller's attention of group r hides it."""

        def start(item: tuple[int, dict[str, torch.Tensor]]) -> _Group:
            r, w = item
            projected = project(r, w)
            if self.exchange is None:
                kv_all, handle = comm.all_gather_seq(projected[1], self.group, async_op=True)
            else:
                kv_all, handle = self.exchange.gather(projected[1], self.group)
            return _Group(self, r, w, projected, kv_all, handle)

        stream = self.weight_stream(own)
        nxt = start(next(stream))
        for r in range(self.D):
            cur, nxt = nxt, None
            if r + 1 < self.D and self.options.overlap:
                nxt = start(next(stream))
            yield cur
            del cur  # without overlap, group r's buffers go before group r+1's are made
            if r + 1 < self.D and not self.options.overlap:
                nxt = start(next(stream))

    def segments(self, gathered) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """K/V segments ``(base, K, V [B, L, hk, d])`` of what arrived (heads-major): one of
        all S keys from the all-gather (``natural_kv``), or the window's key ranges."""
        if self.exchange is None:
            return [(0, *self.natural_kv(gathered))]
        return [(base, *split_kv(kv)) for base, kv in gathered.segments()]

    def scatter_kv(self, grads: list[tuple[torch.Tensor, torch.Tensor]]):
        """Dual of the K/V exchange: dK, dV per segment -> ``(dkv [B, 2hk, T, d] in acc,
        handle)``, this rank's rows summed over every rank that read them."""
        if self.exchange is None:
            return comm.reduce_scatter_seq(self.rank_major(*grads[0]), self.group, True)
        heads_major = [torch.cat([dk, dv], dim=2).transpose(1, 2) for dk, dv in grads]
        return self.exchange.scatter(heads_major, self.acc, self.group)

    def norms_of(self, r: int, q_norm, k_norm):
        """The q/k norm weights group ``r`` uses: the per-head ones, or its slices of full-width
        ones (``spec.qk_norm_full``)."""
        if q_norm is None or not self.spec.qk_norm_full:
            return q_norm, k_norm
        return q_norm[self.spec.q_rows(r)], k_norm[self.spec.kv_rows(r)]

    def natural_kv(self, kv_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered ``kv_all [D, B, 2hk, T, d]`` (rank-major, heads-major) -> K, V ``[B, S, hk,
        d]`` in token order (one copy of contiguous blocks: rank q's chunks q and 2D-1-q go to
        their global positions), stored heads-major (see ``heads_major``)."""
        D, B, two_hk, T, d = kv_all.shape
        kv = kv_all.new_empty(B, two_hk, D * T, d)
        for q in range(D):
            for s in self.layout.spans(q):
                kv[:, :, s.start : s.stop] = kv_all[q, :, :, s.offset : s.offset + s.length]
        return split_kv(kv)

    def rank_major(self, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """Inverse of ``natural_kv`` for gradients: dK, dV ``[B, S, hk, d]`` -> ``[D, B, 2hk, T,
        d]`` in the accumulation dtype, ready to reduce-scatter."""
        B, S, hk, d = dk.shape
        out = dk.new_empty(self.D, B, 2 * hk, S // self.D, d, dtype=self.acc)
        for q in range(self.D):
            for s in self.layout.spans(q):
                rows = out[q, :, :, s.offset : s.offset + s.length]
                rows[:, :hk] = dk[:, s.start : s.stop].transpose(1, 2)
                rows[:, hk:] = dv[:, s.start : s.stop].transpose(1, 2)
        return out


class _Group:
    """One head group in flight: ``r``, its weights ``w``, the caller's ``projected`` tuple and
    its K/V all-gather (``kv()`` waits for it)."""

    def __init__(self, sched: _Schedule, r: int, w, projected: tuple, kv_all, handle) -> None:
        self.sched, self.r, self.w, self.projected = sched, r, w, projected
        self._kv_all, self._handle = kv_all, handle

    def kv(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Wait for the exchange; ``(base, K, V [B, L, n_kv(r), d])`` segments in token order
        (heads-major; all-gathered: one, base 0, L = S). The local K/V it sent
        (``projected[1]``) is dropped: nothing reads it after the exchange."""
        self._handle.wait()
        kv_all, self._kv_all = self._kv_all, None
        self.projected = (self.projected[0], None, *self.projected[2:])
        return self.sched.segments(kv_all)


def _in_segment(q_spans, base: int, stop: int):
    """The query spans whose keys lie in the segment ``[base, stop)``, in its coordinates."""

    def shift(spans):
        return tuple(
            Span(s.offset, s.start - base, s.length, max(s.first_key - base, 0))
            for s in spans
            if base <= s.start and s.stop <= stop
        )

    if isinstance(q_spans, RowSpans):
        return RowSpans(tuple(shift(row) for row in q_spans.rows))
    return shift(q_spans)


def segments_forward(kernel, q, q_spans, segments, scale: float, window: int | None):
    """``chunked_attention_forward`` of ``q [B, T, Hq, d]`` over K/V ``segments`` ``(base, K,
    V)``; a query's keys are all in one segment (rows of other segments' spans stay 0, -inf)."""
    out = lse = None
    for base, k, v in segments:
        spans = _in_segment(q_spans, base, base + k.shape[1])
        o, l = chunked_attention_forward(kernel, q, spans, k, v, scale, window)
        out, lse = (o, l) if out is None else (out.add_(o), torch.maximum(lse, l))
    return out, lse


def segments_backward(kernel, da, q, q_spans, segments, a, lse, scale, window):
    """Gradients of ``segments_forward``: dq and ``[(dK, dV)]`` per segment."""
    dq, grads = None, []
    for base, k, v in segments:
        spans = _in_segment(q_spans, base, base + k.shape[1])
        g_q, g_k, g_v = chunked_attention_backward(
            kernel, da, q, spans, k, v, a, lse, scale, window
        )
        dq = g_q if dq is None else dq.add_(g_q)
        grads.append((g_k, g_v))
    return dq, grads


def output_backward(
    dy: torch.Tensor,
    wo: torch.Tensor,
    a: torch.Tensor,
    acc: torch.dtype,
    weight_grad: bool = True,
    lora: tuple | None = None,
):
    """Backward of ``Y += A · Woᵀ`` for one group, both straight from the heads-major layout
    (no copy of A or of dA): ``dA = dY · Wo`` as a ``[B, T, n_q, d]`` view of heads-major
    storage, and ``dWo = dYᵀ · A [h, n_q·d]`` in ``acc`` (None unless ``weight_grad``). ``a``: the
    group's ``A [B, n_q, T, d]`` (a slice of the saved heads-major A).

    ``lora = (dZ [B, T, r], Ao_r [r, n_q·d], mask, Z, merged)`` for the adapter's ``Z +=
    drop(A)·Ao_rᵀ``: ``dA += drop⁻(dZ · Ao_r)`` (unless ``merged``: ``wo`` is the merged weight,
    whose ``dA`` has it), returns ``dAo_r = dZᵀ · drop(A)`` in ``acc`` third (else None) and adds
    this group's term into ``Z [B·T, r]`` (rebuilt for B's gradient); ``mask``: the dropout mask
    ``[B, T, n_q·d]`` or None."""
    B, nq, T, d = a.shape
    h = dy.shape[-1]
    da = torch.matmul(dy.unsqueeze(1), wo.view(h, nq, d).transpose(0, 1))  # [B, n_q, T, d]
    dwo = d_ao = None
    if weight_grad:
        dy_t = dy.flatten(0, 1).t()
        dwo = torch.cat([matmul(dy_t, a[:, j].reshape(B * T, d), acc) for j in range(nq)], dim=1)
    if lora is not None:
        dz, ao, mask, z, merged = lora
        r = ao.shape[0]
        a_in = a.transpose(1, 2).reshape(B * T, nq * d)  # token-major copy: the adapter's input
        if mask is not None:
            a_in.mul_(mask.view(B * T, -1))
        if not merged:
            ao_heads = ao.to(da.dtype).view(r, nq, d).transpose(0, 1)  # [n_q, r, d]
            d_in = torch.matmul(dz.to(da.dtype).unsqueeze(1), ao_heads)  # [B, n_q, T, d]
            if mask is not None:
                d_in.mul_(mask.view(B, T, nq, d).transpose(1, 2))
            da += d_in
        d_ao = matmul(dz.reshape(B * T, r).t(), a_in, acc)
        add_matmul(z, a_in, ao.t())
    return da.transpose(1, 2), dwo, d_ao


def heads_major(t: torch.Tensor) -> torch.Tensor:
    """The same ``[B, L, H, d]`` values stored as ``[B, H, L, d]`` (returned as a ``[B, L, H, d]``
    view): the fused kernels run up to 2x faster on that layout, GQA backward most of all."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def expand_kv(k: torch.Tensor, v: torch.Tensor, kv_map: list[int] | None):
    """K, V ``[B, S, hk, d]`` -> ``[B, S, hq, d]`` with query head j's KV head at position j
    (heads-major), when the group's map is not the kernels' GQA map; unchanged otherwise."""
    if kv_map is None:
        return k, v
    index = torch.tensor(kv_map, device=k.device)
    return heads_major(k.index_select(2, index)), heads_major(v.index_select(2, index))


def fold_kv(dk: torch.Tensor, kv_map: list[int] | None, hk: int) -> torch.Tensor:
    """Dual of ``expand_kv`` for a gradient: ``[B, S, hq, d]`` -> ``[B, S, hk, d]``, summed over
    the query heads sharing each KV head."""
    if kv_map is None:
        return dk
    index = torch.tensor(kv_map, device=dk.device)
    return dk.new_zeros(*dk.shape[:2], hk, dk.shape[3]).index_add_(2, index, dk)


def tsp_attention_forward(
    sched: _Schedule,
    x,
    phases,
    own,
    q_norm,
    k_norm,
    keep: bool = True,
    lora_a: list[torch.Tensor] | None = None,
    kv_sink: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    key_valid: torch.Tensor | None = None,
    rms: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Forward schedule (RoPE by ``phases``, ``pointwise.rope_phases`` of the tokens' cos/sin;
    ``rms``: the tokens' full-width q/k reciprocal RMS, ``engine.qk_rms``, with
    ``spec.qk_norm_full``).
    Returns ``Y_p [B, T, h]`` plus, if ``keep``, ``A [B, n_h, T, d]`` and ``lse [B, n_h, T]`` of
    every group's heads (what backward needs), else None for both. LoRA: ``lora_a`` the
    replicated A's of ``sched.lora.inputs`` (o's replicated B: ``sched.set_adapters``).

    Inference only (training passes neither): ``kv_sink(r, K_r, V_r)`` receives each group's
    all-gathered K/V ``[B, S, n_kv(r), d]`` in token order (a prefill keeps its own group's as its
    KV cache, no extra traffic); ``key_valid [B, S]`` (bool) hides padded keys (left padding),
    computed by ``masked_chunked_attention`` instead of the fused kernels."""
    B, T, _ = x.shape
    spec = sched.spec
    y = x.new_zeros(B, T, spec.hidden_size, dtype=sched.acc)
    # A of every group, heads-major: [B, n_h, T, d]; group r fills its heads q_heads(r)
    a_all = x.new_empty(B, spec.n_heads, T, spec.head_dim) if keep else None
    lse_all = None
    u = z = None
    if not sched.merged:  # the adapters' terms apart from the base's (dropout)
        u = (
            input_projection(x.reshape(B * T, -1), lora_a, sched.lora, sched.drop)
            if lora_a
            else None
        )
        z = x.new_zeros(B * T, own["lo"].shape[0], dtype=sched.acc) if "lo" in own else None

    def project(r, w):
        norms = sched.norms_of(r, q_norm, k_norm)
        return project_qkv(x, w, phases, *norms, spec, sched.stacked(w), u, rms)

    for group in sched.projected_groups(own, project):
        r, w = group.r, group.w
        q = group.projected[0]  # heads-major already
        segments = group.kv()
        del group
        if kv_sink is not None:  # a prefill: gathered all (``gather_all``)
            kv_sink(r, *segments[0][1:])
        segments = [(b, *expand_kv(k, v, spec.kv_map(r))) for b, k, v in segments]
        if key_valid is None:
            a, lse = segments_forward(
                sched.kernel, q, sched.q_spans, segments, spec.scaling, spec.window
            )
        else:
            _, k_all, v_all = segments[0]
            a, lse = masked_chunked_attention(
                q, sched.q_spans, k_all, v_all, key_valid, spec.scaling, spec.window
            )
        if keep:
            if lse_all is None:
                lse_all = lse.new_empty(B, spec.n_heads, T)
            heads = spec.q_heads(r)
            a_all[:, heads], lse_all[:, heads] = a.transpose(1, 2), lse
        add_matmul(y.view(-1, y.shape[-1]), a.reshape(B * T, -1), sched.out_weight(w).t())
        if z is not None:
            add_matmul(z, sched.drop.apply(a.reshape(B * T, -1), (3, r)), w["lo"].t())
        del q, segments, a, lse  # before the next group's are made (without overlap)
    if z is not None:
        add_matmul(y.view(B * T, -1), z, (sched.lora.output * sched.b_out).t())
    return y.to(x.dtype), a_all, lse_all


def share_kv(grads: dict[str, torch.Tensor], spec: AttentionSpec, p: int, group) -> None:
    """Sum, in place, the K/V gradient rows (``wk, wv, bk, bv`` in ``grads``) of each of group
    ``p``'s shared KV heads over the groups using it; each rank sends at most its own rows."""
    d = spec.head_dim
    kv = [n for n in grads if n in _KV]
    for i, users in spec.shared_kv(p):  # in head order: every user visits them alike
        rows = [grads[n][i * d : (i + 1) * d] for n in kv]
        buf = comm.pack(rows)
        comm.sum_among(buf, users, group)
        for row, total in zip(rows, comm.unpack(buf, [r.shape for r in rows])):
            row.copy_(total)


def tsp_attention_backward(
    sched: _Schedule,
    dy,
    saved_x,
    phases,
    own,
    q_norm,
    k_norm,
    a_all,
    lse_all,
    lora_a=None,
    rms=None,
):
    """Backward schedule. Returns ``dX_p``, the fully reduced gradients of this rank's own shards
    in ``sched.trainable`` (dict), this rank's partial gradients of the replicated q/k norm
    weights, of the LoRA A's ``lora_a``, of o's LoRA B (``sched.set_adapters``) and of ``rms``
    (the full-width norms' ``rq, rk``) (each None without).""
    ``saved_x``: what ``pointwise.to_save`` made of X_p. With ``overlap`` X_p is rebuilt once;
    without, for each use (a group's projection, then its weight gradients), so that it is not
    alive during the kernels (memory before speed).

    Per group r: dA_r = dY_p · Wo_r, the attention backward, then the dK/dV reduce-scatter is
    started; group r's projection backward (it needs the reduced dK/dV) runs after group r+1's
    attention, so the reduce-scatter flies behind a whole kernel (without ``overlap``: right
    away, so that one group's buffers are alive at a time). Each group's gradients are
    reduced to their owner; then the rows of each KV head shared by several groups
    (``spec.shared_kv``) are summed among its users only (``comm.sum_among``), so every copy gets
    the sum over all of its users and no buffer exceeds a group's own rows."""
    B, T, h = saved_x[0].shape
    p, spec, acc = sched.p, sched.spec, sched.acc
    names = [n for n in own if n in sched.trainable]  # the gradients reduced to their owner
    dy = dy.contiguous()
    dx = torch.zeros(B, T, h, dtype=acc, device=dy.device)
    u = du = dz = z = None
    b_out = sched.b_out
    if b_out is not None:  # dZ needs only dY; Z is rebuilt group by group for B's gradient
        dz = matmul(dy.reshape(B * T, h), sched.lora.output * b_out, acc)
        z = torch.zeros_like(dz)
    inverse = phases.conj().resolve_conj()  # RoPE's adjoint, for every group's projection
    d_norm = None
    d_own: dict[str, torch.Tensor] = {}
    reductions: list[tuple[int, torch.Tensor, comm.Pending]] = []
    kept_x = from_saved(*saved_x) if sched.options.overlap else None

    def x_p() -> torch.Tensor:
        return kept_x if kept_x is not None else from_saved(*saved_x)

    if lora_a:  # the adapters' input projection, rebuilt (not saved)
        u = input_projection(x_p().reshape(B * T, h), lora_a, sched.lora, sched.drop)
        du = torch.zeros_like(u, dtype=acc)

    def recompute(r, w):
        """Q, K, V of group r from the saved X_p, its projection (only q/k norms read it: None
        without them, so that it is not kept) and its stacked weights."""
        weight = sched.stacked(w)
        u_term = None if sched.merged else u
        norms = sched.norms_of(r, q_norm, k_norm)
        q, kv, lin = project_qkv(x_p(), w, phases, *norms, spec, weight, u_term, rms)
        return q, kv, lin if q_norm is not None else None, weight

    def finish(r, w, weight, lin, dq, dkv, handle, d_out):
        """Group r's projection backward once its dK/dV arrived: dW_r, whose reduction to r is
        posted before the dX GEMM so that it flies behind it. ``d_out``: o's ``{wo, lo}``
        gradients (those trainable)."""
        nonlocal d_norm
        handle.wait()
        dk, dv = split_kv(dkv.to(dy.dtype))
        g, gn, d_lin = project_qkv_backward(
            dq,
            dk,
            dv,
            x_p(),
            w,
            weight,
            lin,
            inverse,
            *sched.norms_of(r, q_norm, k_norm),
            spec,
            acc,
            sched.trainable,
            u,
            rms,
        )
        if gn is not None and spec.qk_norm_full:  # group r's slices, then d(rq), d(rk)
            if d_norm is None:
                d_norm = [torch.zeros_like(t, dtype=acc) for t in (q_norm, k_norm)] + [0, 0]
            d_norm[0][spec.q_rows(r)] += gn[0]
            d_norm[1][spec.kv_rows(r)] += gn[1]
            d_norm[2:] = [a + b for a, b in zip(d_norm[2:], gn[2:])]
        elif gn is not None:
            d_norm = gn if d_norm is None else [a + b for a, b in zip(d_norm, gn)]
        g.update(d_out)
        if names:
            buf = comm.pack([g[n] for n in names], acc)
            reductions.append((r, buf, comm.reduce(buf, r, sched.group, async_op=True)))
        stacked, _, lora = weight
        add_matmul(dx.view(-1, dx.shape[-1]), d_lin, stacked)  # while dW_r travels
        if lora is not None:
            add_matmul(du, d_lin, lora)

    def collect(keep: int) -> None:
        """Wait for all but the last ``keep`` reductions; keep this rank's own sum."""
        while len(reductions) > keep:
            r0, buf0, handle = reductions.pop(0)
            handle.wait()
            if r0 == p:
                d_own.update(zip(names, comm.unpack(buf0, [own[n].shape for n in names])))

    def attend(group: _Group) -> tuple:
        """Group r's attention backward, its dK/dV reduce-scatter posted: ``finish``'s
        arguments."""
        r, w = group.r, group.w
        # while K/V travel: dA = dY_p · Wo_r ;  dWo_r (partial) = dY_pᵀ · A_r
        heads = spec.q_heads(r)
        lora = None
        if dz is not None:
            like = dy.new_empty(B * T, w["lo"].shape[1], dtype=a_all.dtype)
            mask = sched.drop.mask((3, r), like)  # the forward's, drawn again
            lora = (dz.view(B, T, -1), w["lo"], mask, z, sched.merged)
        da, dwo, d_lo = output_backward(
            dy, sched.out_weight(w), a_all[:, heads], acc, "wo" in sched.trainable, lora
        )
        d_out = {n: t for n, t in (("wo", dwo), ("lo", d_lo)) if n in sched.trainable}
        segments = [(b, *expand_kv(k, v, spec.kv_map(r))) for b, k, v in group.kv()]
        q, _, lin, weight = group.projected
        del group
        a = a_all[:, heads].transpose(1, 2)  # [B, T, n_q(r), d]
        dq, grads = segments_backward(
            sched.kernel, da, q, sched.q_spans, segments, a, lse_all[:, heads], spec.scaling,
            spec.window,
        )  # fmt: skip
        del segments
        hk = spec.n_kv(r)
        grads = [tuple(fold_kv(t, spec.kv_map(r), hk) for t in pair) for pair in grads]
        dkv, handle = sched.scatter_kv(grads)
        return r, w, weight, lin, dq, dkv, handle, d_out

    waiting = None  # the previous group's projection backward, run after this group's attention
    for group in sched.projected_groups(own, recompute):
        pending = attend(group)
        del group
        if not sched.options.overlap:  # one group at a time: finished before the next starts
            finish(*pending)
            collect(keep=0)
            del pending  # group r's buffers go before group r+1's are made
            continue
        if waiting is not None:
            finish(*waiting)
            collect(keep=1)
        waiting = pending
    if waiting is not None:
        finish(*waiting)
    collect(keep=0)
    share_kv(d_own, spec, p, sched.group)
    d_own = {n: d_own[n].to(own[n].dtype) for n in names}
    d_rms = None
    if d_norm is not None:
        d_norm, d_rms = d_norm[:2], d_norm[2:] or None
        d_norm = [t.to(n.dtype) for t, n in zip(d_norm, (q_norm, k_norm))]
    d_lora = None
    if du is not None:
        x2 = x_p().reshape(B * T, h)
        dx2 = None if sched.merged else dx.view(B * T, h)  # merged: dX has it already
        d_lora = input_projection_backward(du, x2, lora_a, sched.lora, sched.drop, dx2)
        d_lora = [g.to(a.dtype) for g, a in zip(d_lora, lora_a)]
    d_b_out = None
    if b_out is not None:
        d_b_out = matmul(dy.reshape(B * T, h).t(), z, acc).mul_(sched.lora.output).to(b_out.dtype)
    return dx.to(dy.dtype), d_own, d_norm, d_lora, d_b_out, d_rms


def tsp_attention_prefill(
    x: torch.Tensor,
    phases,
    weights: dict[str, torch.Tensor],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    spec: AttentionSpec,
    group,
    options: EngineOptions,
    kv_sink: Callable[[int, torch.Tensor, torch.Tensor], None],
    key_valid: torch.Tensor | None = None,
    rms: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Inference: the forward schedule of a prompt's tokens ``x [B, S'/D, h]`` (zigzag, one
    causal stream) with nothing kept for backward; ``Y_p [B, S'/D, h]`` (no o bias).
    ``weights``: the head-group shards, adapters merged; ``kv_sink``, ``key_valid`` and ``rms``
    as in ``tsp_attention_forward``."""
    sched = _Schedule(spec, group, options, x, gather_all=True)
    y, *_ = tsp_attention_forward(
        sched, x, phases, weights, q_norm, k_norm, False, None, kv_sink, key_valid, rms
    )
    return y


class _TSPAttentionFunction(torch.autograd.Function):
    """Autograd boundary of the schedule: saves only local tensors, re-communicates in backward.
    Inputs after the norms: the full-width norms' ``rq, rk`` (or None), o's replicated LoRA B (or
    None), the ``n_lora`` replicated LoRA A's, then the shards ``names``."""

    @staticmethod
    def forward(ctx, sched, names, n_lora, x, cos, sin, q_norm, k_norm, rq, rk, b_out, *tensors):
        lora_a, weights = list(tensors[:n_lora]), tensors[n_lora:]
        own = dict(zip(names, weights))
        keep = any(ctx.needs_input_grad)
        needs = ctx.needs_input_grad[11 + n_lora :]
        sched.trainable = frozenset(n for n, need in zip(names, needs) if need)
        packed = any(t.dtype == torch.uint8 for t in weights)  # NF4 bytes (QLoRA's base)
        sched.set_adapters(SeededDropout.for_call(sched.lora.dropout), lora_a, b_out, packed)
        phases = rope_phases(cos, sin, x.dtype)
        rms = None if rq is None else (rq, rk)
        y, a_all, lse_all = tsp_attention_forward(
            sched, x, phases, own, q_norm, k_norm, keep, lora_a, rms=rms
        )
        ctx.sched, ctx.names, ctx.n_lora = sched, names, n_lora
        if keep:  # X_p as its norm's input when it is a norm's output (rebuilt in backward)
            x, norm_weight, ctx.norm = to_save(x)
            saved = (x, norm_weight, cos, sin, q_norm, k_norm, rq, rk, a_all, lse_all, b_out)
            ctx.save_for_backward(*saved, *tensors)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, cos, sin, q_norm, k_norm, rq, rk, a_all, lse_all, b_out, *tensors = (
            ctx.saved_tensors
        )
        lora_a, weights = tensors[: ctx.n_lora], tensors[ctx.n_lora :]
        own = dict(zip(ctx.names, weights))
        phases = rope_phases(cos, sin, x.dtype)
        rms = None if rq is None else (rq, rk)
        dx, d_own, d_norm, d_lora, d_b_out, d_rms = tsp_attention_backward(
            ctx.sched, dy, (x, norm_weight, ctx.norm), phases, own, q_norm, k_norm, a_all,
            lse_all, lora_a, rms,
        )  # fmt: skip
        d_qn, d_kn = d_norm if d_norm is not None else (None, None)
        d_rq, d_rk = d_rms if d_rms is not None else (None, None)
        return (
            None, None, None, dx, None, None, d_qn, d_kn, d_rq, d_rk, d_b_out,
            *(d_lora or ()),
            *(d_own.get(n) for n in ctx.names),
        )  # fmt: skip


def tsp_attention(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: dict[str, torch.Tensor],
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    spec: AttentionSpec,
    group,
    options: EngineOptions,
    q_spans: tuple[Span, ...] | RowSpans | None = None,
    lora: LoraPlan | None = None,
    lora_a: list[torch.Tensor] | None = None,
    b_out: torch.Tensor | None = None,
    rms: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """TSP attention of this rank's tokens: ``x [B, S/D, h]`` -> ``Y_p [B, S/D, h]`` (no o bias).

    ``cos, sin [B or 1, S/D, d]`` are the RoPE tables of the tokens' positions; ``weights``
    holds this rank's head-group shards (``wq, wo, wk, wv`` and optional ``bq, bk, bv``);
    ``q_norm, k_norm`` the replicated per-head norm weights or None (with
    ``spec.qk_norm_full``: the full-width ones, and ``rms = engine.qk_rms.qk_rms(...)``);
    ``q_spans`` the local query spans of packed documents (``engine.documents.query_spans``;
    None: one causal stream).

    LoRA (``engine.lora``): ``lora`` names the adapted projections; ``weights`` then also holds
    the B rows ``lq, lk, lv`` ``[rows, r]`` of the adapted q/k/v and o's A columns ``lo [r,
    n_q·d]``, ``lora_a`` the replicated A's ``[r, h]`` of ``lora.inputs`` and ``b_out`` o's
    replicated B ``[h, r]`` (their gradients are this rank's part: wrap them in
    ``comm.replicated``).
    """
    sched = _Schedule(spec, group, options, x, q_spans, lora)
    B, T, _ = x.shape
    if cos.shape[-2:] != (T, spec.head_dim) or cos.shape != sin.shape:
        raise ValueError(
            f"position_embeddings must be (cos, sin) of shape [B, {T}, {spec.head_dim}] "
            f"for this rank's tokens, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    cos, sin = cos.expand(B, T, -1), sin.expand(B, T, -1)
    lora_a = list(lora_a or ())
    rq, rk = rms if rms is not None else (None, None)
    return _TSPAttentionFunction.apply(
        sched, tuple(weights), len(lora_a), x, cos, sin, q_norm, k_norm, rq, rk, b_out, *lora_a,
        *weights.values(),
    )  # fmt: skip
