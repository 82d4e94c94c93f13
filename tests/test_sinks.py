"""Attention sinks (gpt-oss): TSP attention against Hugging Face's ``GptOssAttention`` on the
same full sequence, training (outputs, every gradient, the sinks' included) and inference
(prefill, then decode steps), on a sliding-window layer and a full layer."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from checks import rel_err
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from tsp_ext import TSPAttention, TSPConfig, ZigzagLayout, pad_sequence, padded_length
from tsp_ext.hf.cache import TSPCacheLayer

pytestmark = pytest.mark.multiproc

TOL = 1e-10
WINDOW = 6
CASES = ((2, 29), (1, 38))  # (batch, sequence length): longer than the window, odd lengths
DECODE_STEPS = 3


def make_config(world: int) -> GptOssConfig:
    heads = (6, 3) if world == 3 else (4, 2)  # query / KV heads: split by every D
    return GptOssConfig(
        hidden_size=64,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=16,
        sliding_window=WINDOW,
        num_hidden_layers=2,  # layer 0 sliding, layer 1 full
        intermediate_size=32,
        num_local_experts=4,
        vocab_size=64,
        attention_bias=True,
        attn_implementation="eager",
    )


def hf_mask(S: int, window: int | None) -> torch.Tensor:
    """The additive ``[1, 1, S, S]`` mask of causal (windowed) attention."""
    i, j = torch.arange(S)[:, None], torch.arange(S)
    hidden = (j > i) | ((j <= i - window) if window else False)
    return torch.zeros(S, S, dtype=torch.float64).masked_fill(hidden, -torch.inf)[None, None]


def hf_layer(cfg: GptOssConfig, layer: int) -> GptOssAttention:
    torch.manual_seed(layer)
    attn = GptOssAttention(cfg, layer).to(torch.float64)
    for p in attn.parameters():  # non-zero biases and sinks
        torch.nn.init.normal_(p, std=0.3)
    return attn


def tsp_rope(rope: GptOssRotaryEmbedding, x: torch.Tensor, pos: torch.Tensor):
    """TSP's ``(cos, sin) [B, T, d]`` for positions ``pos [B, T]``: gpt-oss's rotary tables are
    ``[B, T, d/2]``, applied to the halves of a head, the same as rotate-half RoPE with each
    table repeated."""
    return tuple(torch.cat([t, t], dim=-1) for t in rope(x, pos))


def _training_case(rank, world, layer, B, S) -> dict:
    cfg = make_config(world)
    attn, rope = hf_layer(cfg, layer), GptOssRotaryEmbedding(cfg)
    torch.manual_seed(100 + S)
    x = torch.randn(B, S, cfg.hidden_size, dtype=torch.float64)
    dy = torch.randn_like(x)
    cos, sin = rope(x, torch.arange(S)[None].expand(B, S))
    xr = x.clone().requires_grad_()
    yr, _ = attn(xr, (cos, sin), hf_mask(S, attn.sliding_window))
    (yr * dy).sum().backward()

    lay = ZigzagLayout(padded_length(S, world), world)
    pos = lay.positions(rank)
    real = pos < S
    t_attn = TSPAttention.from_hf(attn, dist.group.WORLD, TSPConfig(attn_block=4))
    assert t_attn.spec.window == attn.sliding_window and t_attn.sinks is not None

    def local(t):  # this rank's real tokens of a full [B, S, ...] tensor
        return lay.shard(pad_sequence(t, world, 0.0), rank)[:, real]

    xl = lay.shard(pad_sequence(x, world, 0.0), rank).requires_grad_()
    yl, _ = t_attn(xl, position_embeddings=tsp_rope(rope, x, pos[None].expand(B, -1)))
    (yl * lay.shard(pad_sequence(dy, world, 0.0), rank)).sum().backward()
    errs = {
        "out": rel_err(yl[:, real], local(yr.detach())),
        "dx": rel_err(xl.grad[:, real], local(xr.grad)),
    }
    ref = dict(attn.named_parameters())
    for name, p in t_attn.named_parameters():
        errs[name] = rel_err(p.grad, t_attn.local_slice(name, ref[name].grad))
    return errs


def _inference_case(rank, world, layer, B, S) -> dict:
    """Prefill of S tokens, then ``DECODE_STEPS`` single tokens, against the HF module on all
    S + steps tokens (causal: each position's output is the same either way)."""
    cfg = make_config(world)
    attn, rope = hf_layer(cfg, layer), GptOssRotaryEmbedding(cfg)
    L = S + DECODE_STEPS
    torch.manual_seed(200 + S)
    x = torch.randn(B, L, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        ref, _ = attn(
            x, rope(x, torch.arange(L)[None].expand(B, L)), hf_mask(L, attn.sliding_window)
        )
    t_attn = TSPAttention.from_hf(attn, dist.group.WORLD, TSPConfig(attn_block=4))
    c = t_attn.spec.kv_replicas
    cache = TSPCacheLayer(c, rank % c, t_attn.spec.window)
    lay = ZigzagLayout(padded_length(S, world), world)
    pos = lay.positions(rank)
    real = pos < S
    xl = lay.shard(pad_sequence(x[:, :S], world, 0.0), rank)
    y = t_attn.prefill(xl, tsp_rope(rope, xl, pos[None].expand(B, -1)), cache, S)
    want = lay.shard(pad_sequence(ref[:, :S], world, 0.0), rank)[:, real]
    errs = {"prefill": rel_err(y[:, real], want)}
    for t in range(S, L):
        index = torch.tensor([t])
        xt = x[:, t : t + 1]
        y = t_attn.decode(xt, tsp_rope(rope, xt, index[None].expand(B, 1)), cache, index)
        errs[f"decode{t - S}"] = rel_err(y, ref[:, t : t + 1])
    return errs


def sinks_worker(rank, world):
    out = {}
    for layer in (0, 1):
        for B, S in CASES:
            out[("train", layer, S)] = _training_case(rank, world, layer, B, S)
            out[("infer", layer, S)] = _inference_case(rank, world, layer, B, S)
    return out


@functools.cache
def results(workers, world):
    return workers.run(sinks_worker, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sinks_match_hf(workers, world):
    for rank, per_case in enumerate(results(workers, world)):
        for case, errs in per_case.items():
            bad = {k: v for k, v in errs.items() if not v < TOL}
            assert not bad, f"D={world} rank={rank} {case}: {bad}"
            if case[0] == "train":  # out, dx and the grads of 4 weights, 4 biases, the sinks
                assert {"sinks", "o_proj.bias", "q_proj.bias"} <= errs.keys() and len(errs) == 11
