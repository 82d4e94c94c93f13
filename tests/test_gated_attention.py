"""Qwen3-Next's full attention (an output gate in q_proj's rows, (1 + w) q/k norms, RoPE on a
quarter of each head): TSP attention against Hugging Face's ``Qwen3NextAttention`` on the same full
sequence, training (outputs and every gradient) and inference (prefill, then decode steps)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from checks import doc_positions, gemma_norm_tol, hf_mask, rel_err
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
)

from tsp_ext import TSPAttention, TSPConfig, ZigzagLayout, pad_sequence, padded_length
from tsp_ext.hf.cache import TSPCacheLayer
from tsp_ext.hf.families import QWEN3_NEXT

# HF runs the q/k norms in float32 even in float64, and TSP's interleaved head dims sum their
# squares in another order: float32 rounding (as Qwen3's and Gemma-3's in test_apply_tsp)
TOL = 1e-6
CASES = ((2, 29),)  # (batch, sequence length): an odd length, padded at every D
DECODE_STEPS = 3
PACKED = ((19, 29), (30, 5, 13))  # two rows' documents (48 tokens: no padding at D <= 4, D = 3)


def make_config() -> Qwen3NextConfig:
    """4 query / 2 KV heads of 16 dims, 4 of them rotated: at D = 3 groups of 2, 1, 1 heads."""
    return Qwen3NextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,
            "partial_rotary_factor": 0.25,
        },
        num_hidden_layers=1,
        vocab_size=64,
        attn_implementation="sdpa",  # eager: softmax in float32
    )


def hf_layer(cfg: Qwen3NextConfig) -> Qwen3NextAttention:
    torch.manual_seed(0)
    attn = Qwen3NextAttention(cfg, 0).to(torch.float64)
    for p in attn.parameters():  # the (1 + w) norms' weights non-zero too
        torch.nn.init.normal_(p, std=0.3)
    return attn


def _training_case(rank, world, B, S, docs=None) -> dict:
    """One causal stream of S tokens, or (``docs``: each row's document lengths) packed rows."""
    cfg = make_config()
    attn, rope = hf_layer(cfg), Qwen3NextRotaryEmbedding(cfg)
    torch.manual_seed(100 + S)
    x = torch.randn(B, S, cfg.hidden_size, dtype=torch.float64)
    dy = torch.randn_like(x)
    full_pos = torch.arange(S).expand(B, S) if docs is None else doc_positions(docs)
    xr = x.clone().requires_grad_()
    yr, _ = attn(xr, rope(x, full_pos), hf_mask(full_pos, None))
    (yr * dy).sum().backward()

    lay = ZigzagLayout(padded_length(S, world), world)
    pos = lay.positions(rank)
    real = pos < S
    kw = {}
    if docs is not None:  # S a multiple of 2D: no padding
        pos = kw["position_ids"] = lay.shard(full_pos, rank)
    t_attn = TSPAttention.from_hf(attn, dist.group.WORLD, TSPConfig(attn_block=4), QWEN3_NEXT)
    assert t_attn.spec.output_gate and t_attn.spec.rotary == 4

    def local(t):  # this rank's real tokens of a full [B, S, ...] tensor
        return lay.shard(pad_sequence(t, world, 0.0), rank)[:, real]

    xl = lay.shard(pad_sequence(x, world, 0.0), rank).requires_grad_()
    yl, _ = t_attn(xl, position_embeddings=rope(xl, pos.expand(B, -1)), **kw)
    (yl * lay.shard(pad_sequence(dy, world, 0.0), rank)).sum().backward()
    errs = {
        "out": rel_err(yl[:, real], local(yr.detach())),
        "dx": rel_err(xl.grad[:, real], local(xr.grad)),
    }
    ref = dict(attn.named_parameters())
    for name, p in t_attn.named_parameters():
        errs[name] = rel_err(p.grad, t_attn.local_slice(name, ref[name].grad))
    return errs


def _inference_case(rank, world, B, S) -> dict:
    """Prefill of S tokens, then ``DECODE_STEPS`` single tokens, against the HF module on all
    S + steps tokens (causal: each position's output is the same either way)."""
    cfg = make_config()
    attn, rope = hf_layer(cfg), Qwen3NextRotaryEmbedding(cfg)
    L = S + DECODE_STEPS
    torch.manual_seed(200 + S)
    x = torch.randn(B, L, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        full_pos = torch.arange(L).expand(B, L)
        ref, _ = attn(x, rope(x, full_pos), hf_mask(full_pos, None))
    t_attn = TSPAttention.from_hf(attn, dist.group.WORLD, TSPConfig(attn_block=4), QWEN3_NEXT)
    c = t_attn.spec.kv_replicas
    cache = TSPCacheLayer(c, rank % c)
    lay = ZigzagLayout(padded_length(S, world), world)
    pos = lay.positions(rank)
    real = pos < S
    xl = lay.shard(pad_sequence(x[:, :S], world, 0.0), rank)
    y = t_attn.prefill(xl, rope(xl, pos[None].expand(B, -1)), cache, S)
    want = lay.shard(pad_sequence(ref[:, :S], world, 0.0), rank)[:, real]
    errs = {"prefill": rel_err(y[:, real], want)}
    for t in range(S, L):
        index = torch.tensor([t])
        xt = x[:, t : t + 1]
        y = t_attn.decode(xt, rope(xt, index[None].expand(B, 1)), cache, index)
        errs[f"decode{t - S}"] = rel_err(y, ref[:, t : t + 1])
    return errs


def gated_worker(rank, world):
    out = {}
    for B, S in CASES:
        out[("train", S)] = _training_case(rank, world, B, S)
        out[("infer", S)] = _inference_case(rank, world, B, S)
    out[("packed", 48)] = _training_case(rank, world, 2, 48, PACKED)
    return out


@functools.cache
def results(workers, world):
    return workers.run(gated_worker, world)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gated_attention_matches_hf(workers, world):
    for rank, per_case in enumerate(results(workers, world)):
        for case, errs in per_case.items():
            bad = {k: v for k, v in errs.items() if not v < gemma_norm_tol("gemma", k, TOL)}
            assert not bad, f"D={world} rank={rank} {case}: {bad}"
            if case[0] != "infer":  # out, dx, the 4 projections (q_proj with the gate), q/k norms
                assert {"q_proj.weight", "q_norm.weight", "k_norm.weight"} <= errs.keys()
                assert len(errs) == 8
