"""Decode schedules: the tensor-parallel (TP) schedule on the unchanged TSP shards.

A decode step has T = batch tokens, far below the T* ≈ P_layer / (4h − 2·n_kv·d) tokens (≈15K
for a Llama-3-8B layer) where moving weights (TSP) beats moving activations (TP). So every rank
holds the step's tokens ``x [B, Tq, h]`` (replicated) and uses only its own shards:

    q, k, v = rope(x · W_pᵀ, global positions)          # head group p, no weight traffic
    K_p, V_p = cache_p.append(k, v)                      # group p's KV heads (kept by prefill)
    a_p = attention(q, K_p, V_p)                         # exact, GQA, padded keys hidden
    x += all_reduce(a_p · Wo_pᵀ)
    x += all_reduce((silu(x̂ · G_pᵀ) ⊙ (x̂ · U_pᵀ)) · Dn_pᵀ)
    logits = all_gather(x̂ · W_vocab_pᵀ)                 # identical full logits on every rank

2L + 2 collectives per step (the vocab-sharded embedding lookup is one all-reduce too).
When every group uses one whole KV head shared by c = D / n_kv_heads groups (``kv_replicas``),
the c ranks sharing a KV head each cache 1/c of its tokens
(32-token blocks, round robin); each computes the partial attention of all c groups' queries
(one all-gather of q) on its tokens, and one all-gather of the partial (out, lse) lets each rank
merge its own heads' c partials by log-sum-exp, in float32 at least; attention sinks (gpt-oss)
join the merged rows once, by the heads' owner. In uneven layouts a KV head used by two groups
is cached in full by both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention.heads import AttentionSpec
from .attention.kv_exchange import expand_kv
from .kernels.lse import add_sink, merge_partials
from .kernels.masked import partial_attention
from .kernels.pointwise import gate_activation
from .parallel import comm

# tokens per block of a KV head's cache split across its replicas (D > n_kv_heads)
KV_BLOCK = 32


def kept_tokens(index: torch.Tensor, replicas: int, replica: int) -> torch.Tensor:
    """Which tokens (global indices ``index [L]``) replica ``replica`` of ``replicas`` caches:
    ``[L]`` bool, blocks of ``KV_BLOCK`` tokens dealt round robin."""
    return (index // KV_BLOCK) % replicas == replica


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    spec: AttentionSpec,
    group,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's query heads to its KV cache.

    Args:
        q: ``[B, Tq, n_q(p), d]``, this rank's heads of the step's tokens (RoPE applied).
        k, v: ``[B, L_p, n_kv(p), d]``, this rank's cached tokens (all of them unless
            ``spec.kv_replicas > 1``, then its share of its KV head's tokens).
        allowed: ``[B, Tq, L_p]`` bool, which cached tokens each query sees (causal, not padding).
        sinks: ``[n_q(p)]``, this rank's heads' sink logits (gpt-oss, ``lse.add_sink``) or None.
    Returns:
        ``[B, Tq, n_q(p), d]`` in q's dtype: exact attention over the whole cache.
    """
    c = spec.kv_replicas
    D, p = comm.size_and_rank(group)
    if c == 1:
        k, v = expand_kv(k, v, spec.kv_map(p))
        out, lse = partial_attention(q, k, v, allowed, scale=spec.scaling)
        if sinks is not None:
            out, _ = add_sink(out, lse, sinks)
        return out.to(q.dtype)
    first, j, hp = p // c * c, p % c, spec.max_q
    # the queries of the c groups sharing this KV head: [B, Tq, c·n_h/D, d]
    q_all, _ = comm.all_gather_seq(q, group)
    q_grp = q_all[first : first + c].permute(1, 2, 0, 3, 4).flatten(2, 3)
    out, lse = partial_attention(q_grp, k, v, allowed, scale=spec.scaling)
    # (out, lse) of every rank in one message: [D, B, Tq, c·n_h/D, d + 1]
    parts, _ = comm.all_gather_seq(torch.cat([out, lse.transpose(1, 2)[..., None]], -1), group)
    mine = parts[first : first + c, :, :, j * hp : (j + 1) * hp]  # [c, B, Tq, n_h/D, d + 1]
    out, lse = merge_partials(list(zip(mine[..., :-1], mine[..., -1])))
    if sinks is not None:  # once, on the merged rows
        out, _ = add_sink(out, lse.transpose(1, 2), sinks)
    return out.to(q.dtype)


def row_parallel(a: torch.Tensor, w: torch.Tensor, group, acc: torch.dtype) -> torch.Tensor:
    """``all_reduce(a · wᵀ)``: ``a [..., k_p]`` and this rank's columns ``w [h, k_p]`` ->
    ``[..., h]`` in a's dtype, summed over the group in ``acc``."""
    y = F.linear(a, w).to(acc)
    comm.all_reduce(y, group)
    return y.to(a.dtype)


def decode_mlp(
    x, gate, up, down, group, acc: torch.dtype, activation: str = "silu"
) -> torch.Tensor:
    """Gated MLP of the replicated ``x [B, Tq, h]`` with this rank's slices ``gate, up [f_p,
    h]``, ``down [h, f_p]``: ``all_reduce((act(x·Gᵀ) ⊙ (x·Uᵀ))·Dnᵀ)`` ``[B, Tq, h]``."""
    gated = gate_activation(F.linear(x, gate), activation) * F.linear(x, up)
    return row_parallel(gated, down, group, acc)


def vocab_embedding(ids: torch.Tensor, rows: torch.Tensor, first: int, group) -> torch.Tensor:
    """Embeddings ``[B, Tq, h]`` of the replicated ``ids [B, Tq]`` from this rank's vocabulary
    rows ``[V_p, h]`` (the first is row ``first``): each rank looks up the ids it owns (zeros
    elsewhere), one all-reduce."""
    local = ids - first
    mine = (local >= 0) & (local < rows.shape[0])
    x = rows[local.clamp(0, rows.shape[0] - 1)] * mine[..., None]
    comm.all_reduce(x, group)
    return x


def gather_vocab_logits(h: torch.Tensor, rows: torch.Tensor, offsets: list[int], group):
    """Full-vocabulary logits ``[B, Tq, V]`` of the replicated ``h [B, Tq, h]`` from this rank's
    LM-head rows ``[V_p, h]`` (``offsets [D + 1]``: every rank's first row, then V): local
    ``[B, Tq, V_p]`` blocks, padded to the largest, all-gathered (identical on every rank)."""
    sizes = [b - a for a, b in zip(offsets, offsets[1:])]
    z = F.linear(h, rows)
    z = F.pad(z, (0, max(sizes) - z.shape[-1]))
    z_all, _ = comm.all_gather_seq(z, group)  # [D, B, Tq, V_max]
    return torch.cat([z_all[q, ..., :n] for q, n in enumerate(sizes)], dim=-1)
