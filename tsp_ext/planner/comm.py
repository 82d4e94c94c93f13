"""Collective traffic of each layout, per decoder layer and per step."""

from __future__ import annotations

from ..engine.feed_forward.moe_traffic import schedule_for, traffic
from .inputs import Cluster, Layout, Transfer, Workload
from .memory import _tsp_seq
from .shapes import (
    ModelShape,
    _heads,
    _layer_params,
    _shard_params,
    _shared_kv_messages,
    _tsp_heads,
    _tsp_shard_params,
    _vocab_params,
    tsp_mlp_columns,
)


def tsp_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> tuple[list, list]:
    """Per-layer and per-step transfers of TSP: weights broadcast (attention) and ringed (MLP)
    in forward and again in backward, weight gradients reduced to owners, K/V all-gathered and
    dK/dV reduce-scattered; embedding rows exchanged and LM-head shards ringed (shard_vocab)
    or the replicated vocabulary gradients all-reduced (with head buckets: the K/V exchanges of
    each bucket in turn, not overlapped). MoE layers ring ⌈E/D⌉ experts, or send
    token rows by all-to-all, as ``engine.feed_forward.moe_traffic.schedule_for`` picks for the
    B·S/D tokens of a rank. Uneven splits: ring buffers carry the largest shard (⌈F/D⌉, ⌈V/D⌉
    rows), broadcasts the largest head group."""
    D, B, h, d, b, acc = lay.tp, w.micro_batch, m.hidden_size, m.head_dim, w.beta, w.acc
    bw, ov = c.bandwidth(1, D), w.overlap
    nh, nkv = _tsp_heads(m, D)
    router = m.num_experts * h
    attn = _layer_params(m, nh, nkv, 0) - 2 * h - router  # the largest head group's shard
    kv = 2 * B * _tsp_seq(w, D) * nkv * d * (D - 1)  # elements received, all D groups
    buckets = 1 if w.head_bucket is None else -(-nkv // w.head_bucket)  # exchanges per group
    layer = [
        Transfer(
            "broadcast attention weights (fwd+bwd)",
            2 * (D - 1) * attn * b,
            2 * D,
            overlapped=ov,
            bandwidth=bw,
        ),
        Transfer(
            "reduce attention weight grads", (D - 1) * attn * acc, D, overlapped=ov, bandwidth=bw
        ),
        *_tsp_mlp_comm(m, w, D, bw),
        Transfer("all-gather K/V (fwd)", kv * b, D * buckets, overlapped=False, bandwidth=bw),
        Transfer(
            "all-gather K/V (bwd)",
            kv * b,
            D * buckets,
            overlapped=ov and buckets == 1,
            bandwidth=bw,
        ),
        Transfer("reduce-scatter dK/dV", kv * acc, D * buckets, overlapped=False, bandwidth=bw),
        Transfer(
            "all-reduce norm grads", 2 * 2 * (D - 1) / D * h * b, 2, overlapped=False, bandwidth=bw
        ),
    ]
    if m.moe:
        layer.append(
            Transfer(
                "all-reduce router grads",
                2 * (D - 1) / D * router * b,
                1,
                overlapped=ov,
                bandwidth=bw,
            )
        )
    messages = _shared_kv_messages(m, D)
    if messages:  # shared KV heads: their gradient rows summed among their users, point to point
        shared = messages * 2 * h * d * acc
        layer.append(
            Transfer(
                "sum shared K/V grads among users", shared, messages, overlapped=False, bandwidth=bw
            )
        )
    step = _tsp_step_comm(m, w, D, bw)
    return layer + _dp_comm(m, w, c, lay, params=_tsp_shard_params(m, D)), step


def _tsp_mlp_comm(m: ModelShape, w: Workload, D: int, bw: float) -> list[Transfer]:
    """One layer's MLP transfers under TSP: the weight ring (dense, or MoE experts), or the MoE
    token rows' all-to-all, whichever ``schedule_for`` picks."""
    h, b, acc, ov = m.hidden_size, w.beta, w.acc, w.overlap
    tokens = w.micro_batch * _tsp_seq(w, D) / D
    schedule = "ring"
    if m.moe:
        k, E, F = m.experts_per_token, m.num_experts, m.intermediate_size
        schedule = schedule_for(w.moe_schedule, tokens, k, E, F=F, h=h, D=D)
    if schedule == "all_to_all":  # token rows: dispatch, combine; X, dY out and dX back
        rows = traffic(tokens, m.experts_per_token, m.num_experts, m.intermediate_size, h=h, D=D)
        return [
            Transfer(
                "all-to-all MoE token rows",
                rows["all_to_all"] * b,
                5,
                overlapped=False,
                bandwidth=bw,
            )
        ]
    mlp = 3 * h * tsp_mlp_columns(m, D)
    return [
        Transfer(
            "ring MLP weights (fwd+bwd)",
            2 * (D - 1) * mlp * b,
            2 * (D - 1),
            overlapped=ov,
            bandwidth=bw,
        ),
        Transfer("ring MLP weight grads", (D - 1) * mlp * acc, D - 1, overlapped=ov, bandwidth=bw),
    ]


def _tsp_step_comm(m: ModelShape, w: Workload, D: int, bw: float) -> list[Transfer]:
    """Per-step transfers of TSP: embedding rows exchanged and LM-head shards ringed
    (shard_vocab), or the replicated vocabulary gradients all-reduced."""
    B, h, b, acc, ov = w.micro_batch, m.hidden_size, w.beta, w.acc, w.overlap
    T, V = _tsp_seq(w, D) / D, m.vocab_size
    if w.shard_vocab:
        ring = (D - 1) * -(-V // D) * h
        return [
            Transfer(
                "ring LM-head shards (fwd+bwd)",
                2 * ring * b + ring * acc,
                3 * (D - 1),
                overlapped=ov,
                bandwidth=bw,
            ),
            Transfer(
                "all-to-all embedding rows",
                2 * (D - 1) / D * B * T * h * b,
                2,
                overlapped=False,
                bandwidth=bw,
            ),
        ]
    tables = 1 if m.tie_embeddings else 2
    return [
        Transfer(
            "all-reduce vocab grads",
            2 * (D - 1) / D * V * h * b * tables,
            2,
            overlapped=ov,
            bandwidth=bw,
        )
    ]


def baseline_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> tuple[list, list]:
    """Per-layer and per-step transfers of TP / SP / TP×SP. TP (DTensor, HF plan): all-reduces
    of ``[B, S/sp, h]``, two in forward (o_proj, down_proj) and five in backward (the input
    gradients of q, k, v, gate, up, each its own column-parallel linear); per step the vocab-
    parallel embedding's output and the LM-head input gradient, and the gathered logits.
    Ulysses: eight all-to-alls of q, k, v and the output (heads / tp) and the all-reduce of
    the weight gradients over the SP group (every rank saw other tokens)."""
    tp, sp, B, h, d, b = lay.tp, lay.sp, w.micro_batch, m.hidden_size, m.head_dim, w.beta
    T, V = w.seq_len / sp, m.vocab_size
    layer, step = [], []
    if tp > 1:
        bw, ar = c.bandwidth(1, tp), 2 * (tp - 1) / tp * B * T * h * b
        layer.append(Transfer("all-reduce activations", 7 * ar, 7, overlapped=False, bandwidth=bw))
        step += [
            Transfer(
                "all-reduce embedding out / LM-head in grad",
                2 * ar,
                2,
                overlapped=False,
                bandwidth=bw,
            ),
            Transfer(
                "all-gather logits",
                (tp - 1) / tp * B * T * V * b,
                1,
                overlapped=False,
                bandwidth=bw,
            ),
        ]
    if sp > 1:
        bw, g = c.bandwidth(tp, sp), (sp - 1) / sp
        nh, nkv = _heads(m, tp)
        a2a = 2 * g * B * T * (2 * nh + 2 * max(nkv, sp)) * d * b
        grads = 2 * g * _shard_params(m, tp) * b
        vocab = 2 * g * (_vocab_params(m, V / tp, V / tp) + V * h * (1 - 1 / tp)) * b
        layer += [
            Transfer("all-to-all q/k/v/out (fwd+bwd)", a2a, 8, overlapped=False, bandwidth=bw),
            Transfer("all-reduce weight grads over sp", grads, 1, overlapped=True, bandwidth=bw),
        ]
        step.append(
            Transfer("all-reduce vocab grads over sp", vocab, 1, overlapped=True, bandwidth=bw)
        )
    return layer + _dp_comm(m, w, c, lay, params=_shard_params(m, tp)), step


def alst_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout) -> tuple[list, list]:
    """Per-layer and per-step transfers of ALST: Ulysses' all-to-alls of q, k, v and the output
    in forward, again in the recomputed forward, and in backward (twelve); ZeRO-3 over all
    sp·dp devices gathers each layer's weights for the forward, the recomputed forward and the
    backward and reduce-scatters its gradients, and likewise the embedding and LM head."""
    sp, N, B, d, b = lay.sp, lay.sp * lay.dp, w.micro_batch, m.head_dim, w.beta
    T, g = w.seq_len / sp, (sp - 1) / sp
    layer = []
    if sp > 1:
        a2a = 3 * g * B * T * (m.num_heads + max(m.num_kv_heads, sp) * 2 + m.num_heads) * d * b
        layer.append(
            Transfer(
                "all-to-all q/k/v/out (fwd, recompute, bwd)",
                a2a,
                12,
                overlapped=False,
                bandwidth=c.bandwidth(1, sp),
            )
        )
    full = _layer_params(m, m.num_heads, m.num_kv_heads, m.mlp_width)
    bw, share = c.bandwidth(1, N), (N - 1) / N
    step = []
    if N > 1:
        layer.append(
            Transfer(
                "ZeRO-3 gather x3, reduce-scatter",
                4 * share * full * b,
                4,
                overlapped=True,
                bandwidth=bw,
            )
        )
        vocab = _vocab_params(m, m.vocab_size, m.vocab_size)
        step.append(
            Transfer(
                "ZeRO-3 vocabulary gather x2, reduce-scatter",
                3 * share * vocab * b,
                3,
                overlapped=True,
                bandwidth=bw,
            )
        )
    return layer, step


def _dp_comm(m: ModelShape, w: Workload, c: Cluster, lay: Layout, params: float) -> list:
    """ZeRO / DDP over dp, per layer: ZeRO-3 gathers the weights in forward and in backward and
    reduce-scatters the gradients; lower stages reduce gradients and gather updated weights."""
    if lay.dp == 1:
        return []
    times = 3 if w.zero_stage == 3 else 2
    nbytes = times * (lay.dp - 1) / lay.dp * params * w.beta
    return [
        Transfer(
            "data parallel (ZeRO)",
            nbytes,
            times,
            overlapped=True,
            bandwidth=c.bandwidth(lay.group, lay.dp),
        )
    ]


COMM = {
    "tsp": tsp_comm,
    "tp": baseline_comm,
    "sp": baseline_comm,
    "tpxsp": baseline_comm,
    "alst": alst_comm,
}
