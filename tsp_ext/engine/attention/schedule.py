"""TSP attention: head-group weights travel by broadcast, K/V by sequence all-gather.

Rank p holds head group p (``⌊n_heads/D⌋`` or ``⌈n_heads/D⌉`` consecutive query heads, the K/V
heads they use, the matching columns of o_proj; ``engine.attention.heads``) and the tokens of zigzag
shard p. Forward, for r = 0..D-1:

    W_r = broadcast(Wq_r, Wk_r, Wv_r, Wo_r, src=r)        # prefetched two groups ahead
    Q, K, V = rope(X_p · [Wq_r; Wk_r; Wv_r]ᵀ)              # local tokens, global positions
    K_all, V_all = all_gather_seq(K, V)                    # only the real KV heads of group r
    A_r, lse_r = causal_attention(Q, K_all, V_all)         # by global position
    Y_p += A_r · Wo_rᵀ                                     # no all-reduce

With ``overlap``, group r+1 is projected and its K/V gather posted before group r attends, so
the gather flies while the attention kernel runs (forward and the backward's recompute alike).
With ``head_bucket`` a group's heads are taken a few KV heads at a time (``HeadGroup.bucket_kv``):
each bucket's K/V is gathered, attended and (backward) its dK/dV reduce-scattered before the
next bucket's exist.

Backward re-broadcasts W_r and re-gathers K/V (recomputed from the saved X_p), reduce-scatters
dK/dV (accumulated in the rank-major rows the reduce-scatter sends, ``kv_exchange.RankMajorGrads``)
and reduces dW_r to its owner r. Saved per rank: X_p (as its RMSNorm's input, which the
norm keeps anyway, when it is one: ``pointwise.to_save``), A_r and lse_r of every group, cos/sin
and the rank's own shards — O(S/D) activations, O(1/D) weights.

A KV head used by several groups (D > n_kv_heads, or a group boundary inside a KV head's query
heads) is replicated on those ranks; its gradient is the sum over all of its users, summed among
those ranks only (point to point) so the copies stay equal.

The pieces: one call's head groups (``head_groups``: the weights' broadcast,
``weight_ring.broadcast_stream``; the K/V exchange and its dual, ``kv_exchange``), a group's
projection (``qkv``). LoRA adapters are a hook, ``hooks.AttentionAdapters``: the schedule asks it
for the shards as they travel and as they are used, and for the adapters' terms of the projection
and the output and their backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from ..adapters.lora import SeededDropout
from ..adapters.nf4 import ShardCodec
from ..kernels.lse import add_sink, sink_grad
from ..kernels.pointwise import TokenRows, add_matmul, matmul, rope_phases, round_in_place, to_save
from ..options import EngineOptions
from ..parallel import comm
from .attend import group_backward, group_forward
from .head_groups import AttentionCall, AttentionInputs, HeadGroup
from .heads import AttentionSpec, HeadPart
from .kv_exchange import share_kv
from .qkv import GroupProjection, Tokens, project_qkv, project_qkv_backward


def output_backward(
    dy: torch.Tensor, wo: torch.Tensor, a: torch.Tensor, acc: torch.dtype, weight_grad: bool = True
):
    """Backward of ``Y += A · Woᵀ`` for one group, both straight from the heads-major layout
    (no copy of A or of dA): ``dA = dY · Wo`` ``[B, n_q, T, d]`` (heads-major storage; the
    adapters' hook may add to it) and ``dWo = dYᵀ · A [h, n_q·d]`` in ``acc`` (None unless
    ``weight_grad``). ``a``: the group's ``A [B, n_q, T, d]`` (a slice of the saved heads-major
    A)."""
    B, nq, T, d = a.shape
    h = dy.shape[-1]
    da = torch.matmul(dy.unsqueeze(1), wo.view(h, nq, d).transpose(0, 1))  # [B, n_q, T, d]
    dwo = None
    if weight_grad:
        dy_t = dy.flatten(0, 1).t()
        dwo = torch.cat([matmul(dy_t, a[:, j].reshape(B * T, d), acc) for j in range(nq)], dim=1)
    return da, dwo


def tsp_attention_forward(
    call: AttentionCall,
    inputs: AttentionInputs,
    keep: bool = True,
    kv_sink: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    key_valid: torch.Tensor | None = None,
):
    """Forward schedule of ``inputs`` (``AttentionInputs``; RoPE by ``pointwise.rope_phases`` of
    their cos/sin; full-width q/k norms, ``spec.qk_norm_full``, with their ``rms``; sinks by
    ``lse.add_sink``). Returns ``Y_p [B, T, h]`` plus, if ``keep``, ``A [B, n_h, T, d]`` and
    ``lse [B, n_h, T]`` of every group's heads (what backward needs), else None for both. LoRA:
    ``inputs.lora_a`` the replicated A's of the adapted q/k/v (the rest:
    ``call.adapters.begin``).

    Inference only (training passes neither): ``kv_sink(r, K_r, V_r)`` receives each group's
    all-gathered K/V ``[B, S, n_kv(r), d]`` in token order (a prefill keeps its own group's as its
    KV cache, no extra traffic); ``key_valid [B, S]`` (bool) hides padded keys (left padding),
    computed by ``masked_chunked_attention`` instead of the fused kernels."""
    x, spec, own = inputs.x, call.spec, inputs.weights
    B, T, _ = x.shape
    tokens = Tokens(x, rope_phases(inputs.cos, inputs.sin, x.dtype, spec.head_dim))
    y = x.new_zeros(B, T, spec.hidden_size, dtype=call.acc)
    # A of every group, heads-major: [B, n_h, T, d]; group r fills its heads q_heads(r)
    a_all = x.new_empty(B, spec.n_heads, T, spec.head_dim) if keep else None
    lse_all = None
    # the adapters' terms apart from W's
    adapters = call.adapters.forward(x, list(inputs.lora_a), own, call.acc)

    def project(part, w):
        q, kv, _ = project_qkv(tokens, call.projection(part, w, inputs.norms, adapters.u), spec)
        return q, kv  # the pre-norm projection is not kept: only the backward reads it

    for group in call.projected_groups(own, project):
        r, w, heads = group.r, group.w, group.part.q
        q = group.projected[0]  # heads-major already
        a, lse = group_forward(group, q, kv_sink, key_valid)
        del group
        if inputs.sinks is not None:  # A and lse with the sink, as kept for backward
            a, lse = add_sink(a, lse, inputs.sinks[heads])
        if keep:
            if lse_all is None:
                lse_all = lse.new_empty(B, spec.n_heads, T)
            a_all[:, heads], lse_all[:, heads] = a.transpose(1, 2), lse
        if spec.output_gate:  # Qwen3-Next: A · sigmoid(X · Wg_rᵀ), per head and dim
            a = a * torch.sigmoid(torch.nn.functional.linear(x, w["wg"])).view(a.shape)
        wo = call.adapters.out_weight(w)
        add_matmul(y.view(-1, y.shape[-1]), a.reshape(B * T, -1), wo.t())
        adapters.add_group(r, a, w)
        del q, a, lse  # before the next group's are made (without overlap)
    adapters.add_output(y.view(B * T, -1))
    return round_in_place(y, x.dtype), a_all, lse_all


class AttentionGrads(NamedTuple):
    """What ``tsp_attention_backward`` returns: ``dX_p``, the fully reduced gradients of this
    rank's own shards in ``call.trainable``, and this rank's partial gradients of the
    replicated ones (None where absent): the q/k norm weights, the LoRA A's, o's LoRA B and the
    full-width norms' ``rq, rk`` (``engine.attention.qk_rms``) and the sinks ``[n_h]``."""

    dx: torch.Tensor
    d_own: dict[str, torch.Tensor]
    d_norm: list[torch.Tensor] | None
    d_lora: list[torch.Tensor] | None
    d_b_out: torch.Tensor | None
    d_rms: list[torch.Tensor] | None
    d_sinks: torch.Tensor | None


class _Attended(NamedTuple):
    """A group whose attention backward is done and whose projection backward is not: what
    ``_Backward.finish`` takes once the dK/dV exchange ``handle`` has landed in ``dkv``."""

    part: HeadPart
    projection: GroupProjection  # as recomputed (its ``u``: the recomputation's)
    lin: torch.Tensor | None  # the recomputed projection (kept only for q/k norms)
    dq: torch.Tensor
    dkv: torch.Tensor  # this rank's dK/dV rows [B, 2hk, T, d], complete after handle.wait()
    handle: comm.Pending
    d_out: dict[str, torch.Tensor]  # o's shards' gradients (``wo``, ``lo``: the trainable ones)


class _Backward:
    """The backward schedule's state (``tsp_attention_backward``): dX, the norms' gradients, the
    reductions of the groups' weight gradients in flight, the adapters' pass."""

    def __init__(self, call: AttentionCall, inputs: AttentionInputs, dy, fwd) -> None:
        x = inputs.x  # TokenRows
        B, T, h = x.shape
        self.call, self.inputs, self.own = call, inputs, inputs.weights
        self.a_all, self.lse_all = fwd
        sinks = inputs.sinks
        self.d_sinks = None if sinks is None else torch.zeros_like(sinks, dtype=self.lse_all.dtype)
        self.names = [n for n in self.own if n in call.trainable]  # the gradients reduced to owners
        self.dy = dy.contiguous()
        self.dx = torch.zeros(B, T, h, dtype=call.acc, device=dy.device)
        # RoPE's phases by the saved tokens' dtype, and their adjoint, for every group
        self.phases = rope_phases(inputs.cos, inputs.sin, x.t.dtype, call.spec.head_dim)
        self.inverse = self.phases.conj().resolve_conj()
        self.d_norm = None
        self.d_own: dict[str, torch.Tensor] = {}
        self.reductions: list[tuple[HeadPart, torch.Tensor, comm.Pending]] = []
        self.kept_x = x.full() if call.options.overlap else None
        self.adapters = call.adapters.backward(
            self.dy.view(B * T, h),
            lambda: self.x_p().reshape(B * T, h),
            list(inputs.lora_a),
            call.acc,
        )

    def x_rows(self) -> TokenRows:
        """X_p: kept with ``overlap``, else rebuilt for each use (by a projection and its weight
        gradients, a tile of rows at a time)."""
        return TokenRows(self.kept_x) if self.kept_x is not None else self.inputs.x

    def x_p(self) -> torch.Tensor:
        """X_p whole (what the output gate and the adapters read)."""
        return self.x_rows().full()

    def recompute(self, part, w):
        """Q, K, V of ``part``'s heads from the saved X_p, their projection (only q/k norms read
        it: None without them, so that it is not kept) and their ``GroupProjection``."""
        call, norms = self.call, self.inputs.norms
        projection = call.projection(part, w, norms, self.adapters.u_term)
        q, kv, lin = project_qkv(Tokens(self.x_rows(), self.phases), projection, call.spec)
        return q, kv, lin if norms.q is not None else None, projection

    def attend(self, group: HeadGroup) -> _Attended:
        """Group r's (or one of its buckets') attention backward, its dK/dV exchange posted."""
        call, spec, r, w, part = self.call, self.call.spec, group.r, group.w, group.part
        heads, sinks = part.q, self.inputs.sinks
        # while K/V travel: dA = dY_p · Wo_r ;  dWo_r (partial) = dY_pᵀ · A_r
        a = self.a_all[:, heads]  # [B, n_q(r), T, d]
        gate = self.gate(w, a) if spec.output_gate else None
        a_out = a if gate is None else a * gate
        wo, weight_grad = call.adapters.out_weight(w), "wo" in call.trainable
        da, dwo = output_backward(self.dy, wo, a_out, call.acc, weight_grad=weight_grad)
        d_lo = self.adapters.output_backward(r, w.get("lo"), a_out, da)
        d_out = {n: t for n, t in (("wo", dwo), ("lo", d_lo)) if n in call.trainable}
        if gate is not None:
            da, d_wg = self.gate_backward(w, a, gate, da)
            if d_wg is not None:
                d_out["wg"] = d_wg
        if sinks is not None:  # this rank's tokens' part
            self.d_sinks[heads] += sink_grad(da, a, self.lse_all[:, heads], sinks[heads])
        q, lin, projection = group.projected[0], group.projected[2], group.projected[3]
        lse, da, a = self.lse_all[:, heads], da.transpose(1, 2), a.transpose(1, 2)
        dq, dkv, handle = group_backward(group, q, da, (a, lse))
        del group
        return _Attended(
            part=part,
            projection=projection,
            lin=lin,
            dq=dq,
            dkv=dkv,
            handle=handle,
            d_out=d_out,
        )

    def gate(self, w, a: torch.Tensor) -> torch.Tensor:
        """The output gate ``sigmoid(X_p · Wg_rᵀ)`` of group r, heads-major like ``a``."""
        B, nq, T, d = a.shape
        g = torch.nn.functional.linear(self.x_p(), w["wg"]).view(B, T, nq, d)
        return torch.sigmoid(g).transpose(1, 2)

    def gate_backward(self, w, a, gate, da_out) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Backward of ``A · gate``: returns dA and, if trainable, ``dWg_r = dGᵀ · X_p`` (else
        None; dG: the gate's pre-sigmoid gradient); adds ``dX += dG · Wg_r``."""
        B, nq, T, d = a.shape
        dg = (da_out * a * gate * (1 - gate)).transpose(1, 2).reshape(B * T, nq * d)
        d_wg = None
        if "wg" in self.call.trainable:
            d_wg = matmul(dg.t(), self.x_p().reshape(B * T, -1), self.call.acc)
        add_matmul(self.dx.view(B * T, -1), dg, w["wg"])
        return da_out * gate, d_wg

    def finish(self, g: _Attended) -> None:
        """Group r's projection backward once its dK/dV arrived: dW_r, whose reduction to r is
        posted before the dX GEMM so that it flies behind it."""
        call = self.call
        g.handle.wait()
        grads, gn, d_lin = project_qkv_backward(
            g.dq,
            g.dkv.to(self.dy.dtype),
            Tokens(self.x_rows(), self.inverse),
            g.projection._replace(u=self.adapters.u),
            lin=g.lin,
            spec=call.spec,
            acc=call.acc,
            trainable=call.trainable,
        )
        self.add_norms(g.part, gn)
        grads.update(g.d_out)
        if self.names:
            buf = comm.pack([grads[n] for n in self.names], call.acc)
            handle = comm.reduce(buf, g.part.r, call.group, async_op=True)
            self.reductions.append((g.part, buf, handle))
        stacked, _, lora = g.projection.weight
        add_matmul(self.dx.view(-1, self.dx.shape[-1]), d_lin, stacked)  # while dW_r travels
        self.adapters.projection_backward(d_lin, lora)

    def add_norms(self, part: HeadPart, gn) -> None:
        """Add the q/k norm gradients of ``part``'s heads: per-head ones, or their slices of
        full-width ones followed by ``d(rq), d(rk)``."""
        if gn is None:
            return
        if not self.call.spec.qk_norm_full:
            self.d_norm = gn if self.d_norm is None else [a + b for a, b in zip(self.d_norm, gn)]
            return
        if self.d_norm is None:
            norms = (self.inputs.q_norm, self.inputs.k_norm)
            self.d_norm = [torch.zeros_like(t, dtype=self.call.acc) for t in norms] + [0, 0]
        self.d_norm[0][part.q_rows] += gn[0]
        self.d_norm[1][part.kv_rows] += gn[1]
        self.d_norm[2:] = [a + b for a, b in zip(self.d_norm[2:], gn[2:])]

    def collect(self, keep: int) -> None:
        """Wait for all but the last ``keep`` reductions; keep this rank's own sum (a bucket's
        into its rows of the shards' gradients)."""
        d = self.call.spec.head_dim
        while len(self.reductions) > keep:
            part, buf, handle = self.reductions.pop(0)
            handle.wait()
            if part.r != self.call.p:
                continue
            if part.bucket is None:
                shapes = [self.own[n].shape for n in self.names]
                self.d_own.update(zip(self.names, comm.unpack(buf, shapes)))
                continue
            at = [part.bucket.index(n, d) for n in self.names]
            shapes = [self.own[n][i].shape for n, i in zip(self.names, at)]
            for n, i, g in zip(self.names, at, comm.unpack(buf, shapes)):
                if n not in self.d_own:
                    self.d_own[n] = g.new_empty(self.own[n].shape)
                self.d_own[n][i] = g

    def run(self) -> AttentionGrads:
        call = self.call
        waiting = None  # the previous group's projection backward, run after this group's attention
        for group in call.projected_groups(self.own, self.recompute):
            pending = self.attend(group)
            del group
            if not call.options.overlap:  # one group at a time: finished before the next starts
                self.finish(pending)
                self.collect(keep=0)
                del pending  # group r's buffers go before group r+1's are made
                continue
            if waiting is not None:
                self.finish(waiting)
                self.collect(keep=1)
            waiting = pending
        if waiting is not None:
            self.finish(waiting)
        self.collect(keep=0)
        return self.result()

    def result(self) -> AttentionGrads:
        own, call = self.own, self.call
        share_kv(self.d_own, call.spec, call.p, call.group)
        d_own = {n: self.d_own[n].to(own[n].dtype) for n in self.names}
        d_norm = d_rms = None
        if self.d_norm is not None:
            d_norm, d_rms = self.d_norm[:2], self.d_norm[2:] or None
            norms = (self.inputs.q_norm, self.inputs.k_norm)
            d_norm = [t.to(n.dtype) for t, n in zip(d_norm, norms)]
        B, T, h = self.dx.shape
        d_lora, d_b_out = self.adapters.finish(
            self.dx.view(B * T, h), self.dy.view(B * T, h), lambda: self.x_p().reshape(B * T, h)
        )
        sinks = self.inputs.sinks
        d_sinks = None if sinks is None else self.d_sinks.to(sinks.dtype)
        dx = round_in_place(self.dx, self.dy.dtype)
        return AttentionGrads(
            dx=dx,
            d_own=d_own,
            d_norm=d_norm,
            d_lora=d_lora,
            d_b_out=d_b_out,
            d_rms=d_rms,
            d_sinks=d_sinks,
        )


def tsp_attention_backward(
    call: AttentionCall, inputs: AttentionInputs, dy: torch.Tensor, fwd
) -> AttentionGrads:
    """Backward schedule (``AttentionGrads``) given ``dy [B, T, h]`` and the forward's ``fwd =
    (a_all, lse_all)`` (with the sinks, if any). ``inputs.x``: ``TokenRows`` of what
    ``pointwise.to_save`` made of X_p. With ``overlap`` X_p is rebuilt once; without, for each
    use (a group's projection, then its weight gradients), so that it is not alive during the
    kernels (memory before speed).

    Per group r: dA_r = dY_p · Wo_r, the attention backward, then the dK/dV reduce-scatter is
    started; group r's projection backward (it needs the reduced dK/dV) runs after group r+1's
    attention, so the reduce-scatter flies behind a whole kernel (without ``overlap``: right
    away, so that one group's buffers are alive at a time). Each group's gradients are
    reduced to their owner; then the rows of each KV head shared by several groups
    (``spec.shared_kv``) are summed among its users only (``comm.sum_among``), so every copy gets
    the sum over all of its users and no buffer exceeds a group's own rows."""
    return _Backward(call, inputs, dy, fwd).run()


def tsp_attention_prefill(
    inputs: AttentionInputs,
    spec: AttentionSpec,
    group,
    options: EngineOptions,
    kv_sink: Callable[[int, torch.Tensor, torch.Tensor], None],
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inference: the forward schedule of a prompt's tokens ``inputs.x [B, S'/D, h]`` (zigzag,
    one causal stream) with nothing kept for backward; ``Y_p [B, S'/D, h]`` (no o bias).
    ``inputs.weights``: the head-group shards, adapters merged; ``kv_sink``, ``key_valid`` as in
    ``tsp_attention_forward``."""
    call = AttentionCall(spec, group, options, inputs.x, gather_all=True)
    y, *_ = tsp_attention_forward(call, inputs, keep=False, kv_sink=kv_sink, key_valid=key_valid)
    return y


class _TSPAttentionFunction(torch.autograd.Function):
    """Autograd boundary of the schedule: saves only local tensors, re-communicates in backward.
    Inputs: the call, its ``AttentionInputs``, then their ``tensors()`` (what autograd tracks)."""

    @staticmethod
    def forward(ctx, call: AttentionCall, inputs: AttentionInputs, *tensors):
        own = inputs.weights
        keep = any(ctx.needs_input_grad)
        needs = ctx.needs_input_grad[len(ctx.needs_input_grad) - len(own) :]
        call.trainable = frozenset(n for n, need in zip(own, needs) if need)
        x = inputs.x
        packed = bool(ShardCodec(own, x.dtype).packed)  # NF4 bytes (QLoRA's base)
        drop = SeededDropout.for_call(call.adapters.plan.dropout)
        call.adapters.begin(drop, list(inputs.lora_a), inputs.b_out, packed)
        y, a_all, lse_all = tsp_attention_forward(call, inputs, keep)
        ctx.call = call
        ctx.inputs = inputs.with_tensors([None] * len(tensors))  # the names, the spans, the plan
        if keep:  # X_p as its norm's input when it is a norm's output (rebuilt in backward)
            x, norm_weight, ctx.norm = to_save(x)
            ctx.save_for_backward(a_all, lse_all, x, norm_weight, *tensors[1:])
        return y

    @staticmethod
    def backward(ctx, dy):
        a_all, lse_all, x, norm_weight, *tensors = ctx.saved_tensors
        inputs = ctx.inputs.with_tensors([TokenRows(x, norm_weight, ctx.norm), *tensors])
        g = tsp_attention_backward(ctx.call, inputs, dy, (a_all, lse_all))
        d_norm, d_rms = g.d_norm or (None, None), g.d_rms or (None, None)
        grads = (g.dx, None, None, *d_norm, *d_rms, g.d_b_out, g.d_sinks)  # ``tensors()``'s order
        return (
            None,
            None,
            *grads,
            *(g.d_lora or ()),
            *(g.d_own.get(n) for n in inputs.weights),
        )


def tsp_attention(
    inputs: AttentionInputs, spec: AttentionSpec, group, options: EngineOptions
) -> torch.Tensor:
    """TSP attention of this rank's tokens: ``inputs.x [B, S/D, h]`` -> ``Y_p [B, S/D, h]`` (no o
    bias), for the layer ``spec`` on the TSP ``group`` with ``options``.

    ``inputs`` (``AttentionInputs``): ``cos, sin [B or 1, S/D, d]`` are the RoPE tables of the
    tokens' positions; ``weights`` holds this rank's head-group shards (``wq, wo, wk, wv`` and
    optional ``bq, bk, bv``); ``q_norm, k_norm`` the replicated per-head norm weights or None
    (with ``spec.qk_norm_full``: the full-width ones, and ``rms = qk_rms.qk_rms(...)``);
    ``q_spans`` the local query spans of packed documents
    (``engine.sharding.documents.query_spans``; None: one causal stream).

    LoRA (``engine.adapters.lora``): ``lora`` names the adapted projections; ``weights`` then also
    holds the B rows ``lq, lk, lv`` ``[rows, r]`` of the adapted q/k/v and o's A columns ``lo [r,
    n_q·d]``, ``lora_a`` the replicated A's ``[r, h]`` of ``lora.inputs`` and ``b_out`` o's
    replicated B ``[h, r]`` (their gradients are this rank's part: wrap them in
    ``comm.replicated``). ``sinks [n_h]``: every head's replicated sink logit (gpt-oss), or None;
    its gradient is this rank's part too.
    """
    x, cos, sin = inputs.x, inputs.cos, inputs.sin
    call = AttentionCall(spec, group, options, x, q_spans=inputs.q_spans, lora=inputs.lora)
    B, T, _ = x.shape
    if cos.shape[-2:] != (T, spec.rotary) or cos.shape != sin.shape:
        raise ValueError(
            f"position_embeddings must be (cos, sin) of shape [B, {T}, {spec.rotary}] "
            f"for this rank's tokens, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    cos, sin = cos.expand(B, T, -1), sin.expand(B, T, -1)
    inputs = replace(inputs, cos=cos, sin=sin, lora_a=tuple(inputs.lora_a))
    return _TSPAttentionFunction.apply(call, inputs, *inputs.tensors())
