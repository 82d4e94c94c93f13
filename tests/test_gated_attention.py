"""Qwen3-Next's full attention (an output gate in q_proj's rows, (1 + w) q/k norms, RoPE on a
quarter of each head): TSP attention against Hugging Face's ``Qwen3NextAttention`` on the same full
sequence, training (outputs and every gradient) and inference (prefill, then decode steps)."""

from __future__ import annotations

import functools

import pytest
import torch
from attention_cases import AttentionCase
from checks import gemma_norm_tol
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
)

from tsp_ext import TSPConfig
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


BUCKETED = TSPConfig(attn_block=4, head_bucket=1, overlap=False)


def gated_worker(rank, world):
    cfg = make_config()
    case = AttentionCase(hf_layer(cfg), Qwen3NextRotaryEmbedding(cfg), QWEN3_NEXT)
    spec = case.tsp().spec
    assert spec.output_gate and spec.rotary == 4
    out = {}
    for B, S in CASES:
        out[("train", S)] = case.training(rank, world, B, S)
        out[("infer", S)] = case.inference(rank, world, B, S, DECODE_STEPS)
    out[("packed", 48)] = case.training(rank, world, 2, 48, PACKED)
    out[("bucketed", 48)] = case.training(rank, world, 2, 48, PACKED, BUCKETED)  # head buckets
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
