"""One TSP attention call's head groups: the context the attention schedule
(``engine.attention.schedule``) and the full-width q/k RMS (``engine.attention.qk_rms``) share.

Rank p owns head group p's shards; a call streams every group's shards past every rank
(``weight_ring.broadcast_stream``), projects the local tokens with each (``projected_groups``)
and exchanges the group's K/V (``kv_exchange``). The adapters' hook
(``adapters.hooks.AttentionAdapters``) decides how the shards travel and are merged. What a
call computes with is its ``AttentionInputs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..adapters.hooks import AttentionAdapters
from ..adapters.lora import LoraPlan
from ..adapters.nf4 import ShardCodec
from ..kernels.backends import select_backend
from ..kernels.chunked import ChunkedKernel
from ..kernels.pointwise import TokenRows
from ..options import EngineOptions
from ..parallel import comm
from ..parallel.weight_ring import broadcast_stream
from ..sharding.layout import RowSpans, Span, ZigzagLayout
from .heads import SHARDS, AttentionSpec, HeadBucket, HeadPart, ShardKind
from .kv_exchange import KVExchange
from .qkv import GroupProjection, QKNorms, stacked_weights
from .window import WindowExchange


@dataclass(frozen=True)
class AttentionInputs:
    """What one attention call computes with (``schedule.tsp_attention``).

    ``x [B, S/D, h]``: this rank's tokens (in backward, ``TokenRows`` of what was saved of
    them); ``cos, sin [B or 1, S/D, rot]``: the RoPE tables of their positions; ``weights``:
    this rank's head-group shards by ``heads.SHARDS``' names (``wq, wo, wk, wv``, optional
    ``bq, bk, bv``, the output gate's ``wg``; with LoRA the B rows ``lq, lk, lv [rows, r]`` of
    the adapted q/k/v and o's A columns ``lo [r, n_q·d]``); ``q_norm, k_norm``: the replicated
    q/k norm weights or None (full-width ones, ``spec.qk_norm_full``, come with ``rms = (rq,
    rk)`` ``[B, S/D]`` from ``engine.attention.qk_rms``); ``sinks [n_h]``: every head's
    replicated sink logit (gpt-oss) or None; ``q_spans``: the local query spans of packed
    documents (``engine.sharding.documents.query_spans``; None: one causal stream). LoRA
    (``engine.adapters.lora``): ``lora`` names the adapted projections, ``lora_a`` holds the
    replicated A's ``[r, h]`` of ``lora.inputs`` and ``b_out`` o's replicated B ``[h, r]``.
    The gradients of the replicated tensors are this rank's part (wrap them in
    ``comm.replicated``)."""

    x: torch.Tensor | TokenRows
    cos: torch.Tensor
    sin: torch.Tensor
    weights: dict[str, torch.Tensor]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rms: tuple[torch.Tensor, torch.Tensor] | None = None
    sinks: torch.Tensor | None = None
    q_spans: tuple[Span, ...] | RowSpans | None = None
    lora: LoraPlan | None = None
    lora_a: tuple[torch.Tensor, ...] = ()
    b_out: torch.Tensor | None = None

    @property
    def norms(self) -> QKNorms:
        """The q/k norm weights and the full-width norms' ``rms``."""
        return QKNorms(self.q_norm, self.k_norm, self.rms)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor, in the order the autograd function takes them: ``x, cos, sin, q_norm,
        k_norm, rq, rk, b_out, sinks`` (None where absent), the LoRA A's, then the shards."""
        rq, rk = self.rms if self.rms is not None else (None, None)
        first = (self.x, self.cos, self.sin, self.q_norm, self.k_norm, rq, rk, self.b_out)
        return (*first, self.sinks, *self.lora_a, *self.weights.values())

    def with_tensors(self, tensors: Sequence) -> AttentionInputs:
        """These inputs with ``tensors`` (in ``tensors()``'s order) in place of their own."""
        x, cos, sin, q_norm, k_norm, rq, rk, b_out, sinks, *rest = tensors
        n = len(self.lora_a)
        return replace(
            self,
            x=x,
            cos=cos,
            sin=sin,
            q_norm=q_norm,
            k_norm=k_norm,
            rms=None if rq is None else (rq, rk),
            sinks=sinks,
            lora_a=tuple(rest[:n]),
            b_out=b_out,
            weights=dict(zip(self.weights, rest[n:])),
        )


class AttentionCall:
    """One call's fixed context: group, layout, query spans (default: the zigzag chunks; packed
    documents: ``engine.sharding.documents.query_spans``), spec, options, the adapters' hook, the
    shards that get gradients (``trainable``, set by the autograd function) and how K/V travel
    (``kv``): the all-gather, or under a sliding window the ``WindowExchange`` of the keys each
    rank's queries see (unless ``options.window_exchange`` is off or ``gather_all``: a prefill
    keeps every key of its group as its KV cache)."""

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
        self.adapters = AttentionAdapters(lora)
        self.trainable: frozenset[str] = frozenset()
        self.D, self.p = comm.size_and_rank(group)
        self.layout = ZigzagLayout.from_local(x.shape[1], self.D)
        stream = self.layout.spans(self.p)
        self.q_spans = stream if q_spans is None else q_spans
        windowed = spec.window if options.window_exchange and not gather_all else None
        self.acc = options.accum_for(x.dtype)
        window = WindowExchange.for_layout(self.layout, windowed)
        self.kv = KVExchange(self.layout, window, group, self.acc, lean=not options.overlap)
        self.bucket_size = None if gather_all else options.head_bucket
        self.key_block = self.bucket_size is not None  # keys a chunk at a time too
        self.dtype = x.dtype  # what NF4-packed shards (QLoRA's base) are dequantized to
        # packed documents and inference prefill change the kernels' shapes from call to call
        repeating = self.q_spans == stream and torch.is_grad_enabled()
        self.kernel = select_backend(
            options.attn_backend,
            x.device,
            x.dtype,
            block=options.attn_block,
            head_dim=spec.head_dim,
            repeating_shapes=repeating,
        )
        # how the chunked kernels attend (``kernels.chunked``)
        self.chunked = ChunkedKernel(self.kernel, spec.scaling, spec.window, self.key_block)

    def streams(self, bucket: HeadBucket) -> bool:
        """Whether ``bucket``'s K/V stream past a chunk at a time (``engine.attention.key_stream``)
        rather than being all-gathered: with head buckets, in one causal stream or packed
        documents without a sliding window, where the bucket's GQA map is the kernels'."""
        return self.key_block and self.spec.window is None and bucket.kv_map is None

    def shapes(self, r: int, own: dict[str, torch.Tensor], names) -> list[torch.Size]:
        """Shapes of group ``r``'s shards ``names`` (every rank computes them from the spec and
        its own adapter pieces' ranks)."""
        h, d = self.spec.hidden_size, self.spec.head_dim
        nq, nk = self.spec.n_q(r) * d, self.spec.n_kv(r) * d
        rows = {"q": nq, "k": nk, "v": nk, "o": nq, "g": nq}
        sizes = {"wo": (h, nq), **self.adapters.shapes(own, names, rows)}
        for n in names:
            kind, projection = SHARDS[n]
            if kind is ShardKind.WEIGHT and n != "wo":
                sizes[n] = (rows[projection], h)
            elif kind is ShardKind.BIAS:
                sizes[n] = (rows[projection],)
        return [torch.Size(sizes[n]) for n in names]

    def weight_stream(self, own: dict[str, torch.Tensor]):
        """Yield ``(r, W_r)`` for r = 0..D-1 (``weight_ring.broadcast_stream``): W_{r+1} is
        broadcast while the caller works on W_r; this rank's shards travel as the adapters' hook
        makes them (``travelling``), NF4-packed ones are dequantized on arrival."""
        return broadcast_stream(
            own,
            lambda r, names: self.shapes(r, own, names),
            self.group,
            overlap=self.options.overlap,
            outgoing=self.adapters.travelling,
            codec=ShardCodec(own, self.dtype),
        )

    def stacked(self, w: dict[str, torch.Tensor]):
        """``qkv.stacked_weights`` of group shards ``w`` (merged with their adapters where a
        receiver merges them)."""
        return stacked_weights(w, self.spec.head_dim, self.adapters.qkv_merge, self.spec.rotary)

    def projection(
        self, part: HeadPart, w: dict[str, torch.Tensor], norms: QKNorms, u: torch.Tensor | None
    ) -> GroupProjection:
        """How ``part``'s heads are projected (``qkv.project_qkv``): their shards ``w``, stacked
        (``stacked``), the q/k norms they use (``norms_of``) and the LoRA input projection
        ``u``."""
        return GroupProjection(w, self.stacked(w), self.norms_of(part, norms), u)

    def projects_buckets(self, buckets: list[HeadBucket]) -> bool:
        """Whether a group of several head ``buckets`` is projected bucket by bucket too (each
        bucket's Q/K/V, dA, dQ and dK/dV made and consumed before the next one's): where every
        bucket streams its K/V and no LoRA adapter joins the projections."""
        plan = self.adapters.plan
        adapted = bool(plan.inputs) or plan.output is not None
        return len(buckets) > 1 and all(map(self.streams, buckets)) and not adapted

    def projected_groups(self, own: dict[str, torch.Tensor], project: Callable):
        """Yield ``HeadGroup``s r = 0..D-1 (or, ``projects_buckets``, each of group r's buckets
        in turn): W_r (cut to the bucket), ``project(part, W)`` (a tuple starting ``q, k, v``)
        and the K/V exchange of group r in flight. With ``overlap``, the next one is projected
        and its exchange posted before this one is yielded, so the caller's attention hides
        it."""

        def parts():
            for r, w in self.weight_stream(own):
                buckets = self.spec.buckets(r, self.bucket_size)
                if not self.projects_buckets(buckets):
                    yield self.spec.part(r), w, buckets
                    continue
                for b in buckets:
                    yield self.spec.part(r, b), b.shards(w, self.spec.head_dim), [b.whole()]

        def start(item) -> HeadGroup:
            part, w, buckets = item
            projected = project(part, w)
            if len(buckets) > 1 or self.streams(buckets[0]):  # exchanged when attended
                return HeadGroup(self, part, w, projected, buckets=buckets)
            exchange = self.kv.gather(projected[1])
            return HeadGroup(self, part, w, projected, buckets=buckets, exchange=exchange)

        stream = parts()

        def start_next() -> HeadGroup | None:
            item = next(stream, None)
            return None if item is None else start(item)

        nxt = start_next()
        while nxt is not None:
            cur, nxt = nxt, None
            if self.options.overlap:
                nxt = start_next()
            yield cur
            del cur  # without overlap, this one's buffers go before the next one's are made
            if not self.options.overlap:
                nxt = start_next()

    def norms_of(self, part: HeadPart, norms: QKNorms) -> QKNorms:
        """The q/k norms ``part``'s heads use: the per-head ones, or their slices of full-width
        ones (``spec.qk_norm_full``; ``rms`` as it is)."""
        if norms.q is None or not self.spec.qk_norm_full:
            return norms
        return norms._replace(q=norms.q[part.q_rows], k=norms.k[part.kv_rows])


class BucketKV(NamedTuple):
    """A head bucket's K/V as its attention reads them (``HeadGroup.bucket_kv``): the
    ``bucket``, its gathered ``segments`` ``(base, K, V [B, L, n_kv, d])`` in token order, or
    (streamed, ``AttentionCall.streams``) its ``local`` K/V rows ``[B, 2n, T, d]`` (K's heads,
    then V's); the other one None."""

    bucket: HeadBucket
    segments: list[tuple[int, torch.Tensor, torch.Tensor]] | None
    local: torch.Tensor | None


class HeadGroup:
    """One head group (or, ``AttentionCall.projects_buckets``, one of its buckets) in flight:
    its heads ``part`` (``r = part.r``), its weights ``w``, the caller's ``projected`` tuple, its
    head ``buckets`` (``AttentionSpec.buckets``) and, for a single bucket, its K/V ``exchange``
    in flight (``KVExchange.gather``'s ``(gathered, handle)``; ``kv()`` waits for it)."""

    def __init__(
        self,
        call: AttentionCall,
        part: HeadPart,
        w: dict[str, torch.Tensor],
        projected: tuple,
        buckets: list[HeadBucket],
        exchange: tuple | None = None,
    ) -> None:
        self.call, self.part, self.r, self.w, self.projected = call, part, part.r, w, projected
        self.buckets = buckets
        self._kv_all, self._handle = exchange if exchange is not None else (None, None)

    def kv(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Wait for the exchange; ``(base, K, V [B, L, n_kv(r), d])`` segments in token order
        (heads-major; all-gathered: one, base 0, L = S). The local K/V it sent
        (``projected[1]``) is dropped: nothing reads it after the exchange."""
        self._handle.wait()
        kv_all, self._kv_all = self._kv_all, None
        self._drop_local_kv()
        return self.call.kv.segments(kv_all)

    def bucket_kv(self):
        """Yield a ``BucketKV`` for each head bucket in turn: for a streamed bucket
        (``AttentionCall.streams``) its local K/V rows, for any other its segments: a single
        bucket's from ``kv()``, else each bucket's K/V exchanged when its turn comes (the
        previous bucket's are dropped by the caller first)."""
        if self._handle is not None:
            yield BucketKV(self.buckets[0], self.kv(), None)
            return
        kv = self.projected[1]  # [B, 2hk, T, d]: K's heads, then V's
        hk = kv.shape[1] // 2
        for b in self.buckets:  # no reference to a bucket's K/V is kept here past its turn
            rows = kv
            if b.kv != slice(0, hk):
                rows = torch.cat([kv[:, b.kv], kv[:, hk + b.kv.start : hk + b.kv.stop]], dim=1)
            if self.call.streams(b):
                yield BucketKV(b, None, rows)
                continue
            gathered, handle = self.call.kv.gather(rows)
            del rows
            handle.wait()
            yield BucketKV(b, self.call.kv.segments(gathered), None)
        self._drop_local_kv()

    def _drop_local_kv(self) -> None:
        self.projected = (self.projected[0], None, *self.projected[2:])
