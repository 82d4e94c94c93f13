"""One head group's attention kernels over its head buckets (``AttentionSpec.buckets``), forward
and backward, each bucket's K/V exchanged when its turn comes (``HeadGroup.bucket_kv``).

A single bucket (the default: the whole group) attends the K/V exchange the schedule posted
ahead; with ``head_bucket`` each bucket's K/V is gathered, attended and (backward) its dK/dV
reduce-scattered before the next bucket's exist. The backward's dK/dV accumulate in the
rank-major rows the reduce-scatter sends (``kv_exchange.RankMajorGrads``) wherever the
bucket's GQA map is the kernels'.
"""

from __future__ import annotations

import torch

from ..kernels.chunked import segments_backward, segments_forward
from ..kernels.masked import masked_chunked_attention
from ..parallel import comm
from .head_groups import AttentionCall, BucketKV, HeadGroup
from .key_stream import streamed_backward, streamed_forward
from .kv_exchange import expand_kv, fold_kv


def group_forward(group: HeadGroup, q: torch.Tensor, kv_sink=None, key_valid=None):
    """A head group's attention of ``q [B, T, n_q, d]`` (heads-major): ``A [B, T, n_q, d]`` and
    ``lse [B, n_q, T]``. ``kv_sink``, ``key_valid``: as in ``tsp_attention_forward``
    (inference, one bucket)."""
    whole = len(group.buckets) == 1
    a = lse = None
    for kv in group.bucket_kv():
        rows = kv.bucket.q
        q_b = q if whole else q[:, :, rows]
        a_b, lse_b = _bucket_forward(group, kv, q_b, kv_sink=kv_sink, key_valid=key_valid)
        del kv  # before the next bucket's K/V arrive
        if whole:
            return a_b, lse_b
        if a is None:
            a, lse = torch.empty_like(q), lse_b.new_empty(q.shape[0], q.shape[2], q.shape[1])
        a[:, :, rows], lse[:, rows] = a_b, lse_b
    return a, lse


def _bucket_forward(group: HeadGroup, kv: BucketKV, q, kv_sink, key_valid):
    """One bucket's attention: its local K/V streamed (``engine.attention.key_stream``), or over
    its gathered segments (inference: handed to ``kv_sink``, padded keys masked)."""
    call, spec = group.call, group.call.spec
    if kv.local is not None:
        return streamed_forward(call, q, kv.local)
    if kv_sink is not None:  # a prefill: gathered all (``gather_all``, one bucket)
        kv_sink(group.r, *kv.segments[0][1:])
    segments = [(b, *expand_kv(k, v, kv.bucket.kv_map)) for b, k, v in kv.segments]
    if key_valid is None:
        return segments_forward(call.chunked, q, call.q_spans, segments)
    _, k_all, v_all = segments[0]
    return masked_chunked_attention(
        q, call.q_spans, k_all, v_all, key_valid=key_valid, scale=spec.scaling, window=spec.window
    )


def group_backward(group: HeadGroup, q, da, fwd):
    """The attention backward of a head group (``q, da [B, T, n_q, d]``, the forward's ``fwd =
    (a [B, T, n_q, d], lse [B, n_q, T])``): ``(dq, dkv [B, 2 n_kv, T, d], handle)``, the dK/dV
    exchange posted (one bucket) or done (buckets, each waited for before the next bucket's K/V
    arrive)."""
    if len(group.buckets) == 1:
        (kv,) = group.bucket_kv()
        return _bucket_backward(group.call, kv, q, da, fwd=fwd)
    a, lse = fwd
    hk = group.call.spec.n_kv(group.r)
    dq, dkv = torch.empty_like(q), None
    for kv in group.bucket_kv():
        bucket, rows = kv.bucket, kv.bucket.q
        fwd_b = (a[:, :, rows], lse[:, rows])
        dq_b, dkv_b, handle = _bucket_backward(
            group.call, kv, q[:, :, rows], da[:, :, rows], fwd=fwd_b
        )
        del kv
        handle.wait()
        if dkv is None:
            dkv = dkv_b.new_empty(dkv_b.shape[0], 2 * hk, *dkv_b.shape[2:])
        n, kv_heads = bucket.kv.stop - bucket.kv.start, bucket.kv
        dq[:, :, rows] = dq_b
        dkv[:, kv_heads] = dkv_b[:, :n]
        dkv[:, hk + kv_heads.start : hk + kv_heads.stop] = dkv_b[:, n:]
    return dq, dkv, comm.Pending(())


def _bucket_backward(call: AttentionCall, kv: BucketKV, q, da, fwd):
    """One bucket's attention backward over its K/V segments (or its local K/V streamed) given
    the forward's ``fwd = (a, lse)``: dQ, and its dK/dV exchange posted (streamed: done)."""
    spec, bucket = call.spec, kv.bucket
    if kv.local is not None:
        dq, dkv = streamed_backward(call, da, q, kv.local, fwd=fwd)
        return dq, dkv, comm.Pending(())
    B, d, hk = q.shape[0], spec.head_dim, bucket.kv.stop - bucket.kv.start
    # dK/dV straight into the rank-major rows they are reduce-scattered from, where the
    # kernels' GQA map is the bucket's (else they are folded over the expanded heads first)
    into = None if bucket.kv_map else call.kv.grads_into(B, hk, d, q.device)
    segments = [(b, *expand_kv(k, v, bucket.kv_map)) for b, k, v in kv.segments]
    dq, grads = segments_backward(
        call.chunked, da, q, call.q_spans, segments=segments, fwd=fwd, into=into
    )
    del segments
    if into is not None:
        return (dq, *call.kv.scatter_from(into))
    grads = [tuple(fold_kv(t, bucket.kv_map, hk) for t in pair) for pair in grads]
    return (dq, *call.kv.scatter(grads))
