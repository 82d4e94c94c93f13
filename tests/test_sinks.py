"""Attention sinks (gpt-oss): TSP attention against Hugging Face's ``GptOssAttention`` on the
same full sequence, training (outputs, every gradient, the sinks' included) and inference
(prefill, then decode steps), on a sliding-window layer and a full layer."""

from __future__ import annotations

import functools

import pytest
import torch
from attention_cases import AttentionCase
from checks import rel_err
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from tsp_ext import TSPConfig, ZigzagLayout
from tsp_ext.engine.kernels.backends import BACKENDS, available_backends
from tsp_ext.engine.kernels.chunked import (
    ChunkedKernel,
    chunked_attention_backward,
    chunked_attention_forward,
)
from tsp_ext.engine.kernels.lse import add_sink, sink_grad

TOL = 1e-10
WINDOW = 6
CASES = ((2, 29), (1, 38))  # (batch, sequence length): longer than the window, odd lengths
DECODE_STEPS = 3
PACKED = ((19, 29), (30, 5, 13))  # two rows' documents (48 tokens: no padding at D <= 4, D = 3)


def make_config() -> GptOssConfig:
    """4 query / 2 KV heads: at D = 3 groups of 2, 1, 1 query heads, KV head 1 shared by two."""
    return GptOssConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        num_hidden_layers=2,  # layer 0 sliding, layer 1 full
        intermediate_size=32,
        num_local_experts=4,
        vocab_size=64,
        attention_bias=True,
        attn_implementation="eager",
    )


def hf_layer(cfg: GptOssConfig, layer: int) -> GptOssAttention:
    torch.manual_seed(layer)
    attn = GptOssAttention(cfg, layer).to(torch.float64)
    for p in attn.parameters():  # non-zero biases and sinks
        torch.nn.init.normal_(p, std=0.3)
    return attn


def tsp_rope(tables):
    """TSP's ``(cos, sin) [B, T, d]``: gpt-oss's rotary tables are ``[B, T, d/2]``, applied to
    the halves of a head, the same as rotate-half RoPE with each table repeated."""
    return tuple(torch.cat([t, t], dim=-1) for t in tables)


BUCKETED = TSPConfig(attn_block=4, head_bucket=1, overlap=False)


def sinks_worker(rank, world):
    out = {}
    cfg = make_config()
    for layer in (0, 1):
        case = AttentionCase(hf_layer(cfg, layer), GptOssRotaryEmbedding(cfg), tsp_rope=tsp_rope)
        t_attn = case.tsp()
        assert t_attn.spec.window == case.window and t_attn.sinks is not None
        for B, S in CASES:
            out[("train", layer, S)] = case.training(rank, world, B, S)
            out[("infer", layer, S)] = case.inference(rank, world, B, S, DECODE_STEPS)
        out[("packed", layer, 48)] = case.training(rank, world, 2, 48, PACKED)
        # one KV head at a time (head buckets), windowed or not, packed
        out[("bucketed", layer, 48)] = case.training(rank, world, 2, 48, PACKED, BUCKETED)
    return out


@functools.cache
def results(workers, world):
    return workers.run(sinks_worker, world)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sinks_match_hf(workers, world):
    for rank, per_case in enumerate(results(workers, world)):
        for case, errs in per_case.items():
            bad = {k: v for k, v in errs.items() if not v < TOL}
            assert not bad, f"D={world} rank={rank} {case}: {bad}"
            if case[0] != "infer":  # out, dx and the grads of 4 weights, 4 biases, the sinks
                assert {"sinks", "o_proj.bias", "q_proj.bias"} <= errs.keys() and len(errs) == 11


def _kernel_errors(kernel, dtype, device, window) -> dict:
    """A kernel's chunked attention of zigzag rank 1 of D = 2 (S = 256) with ``add_sink``, its
    backward fed (out', lse') and ``sink_grad``, against autograd of a float64 dense softmax
    with the sink as one more logit: max relative errors of out', dq, dk, dv, dσ."""
    S, B, hq, hk, d = 256, 2, 4, 2, 64
    spans = list(ZigzagLayout(S, 2).spans(1))
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, S // 2, hq, d, generator=gen, dtype=torch.float64) for _ in "qg")
    k, v = (torch.randn(B, S, hk, d, generator=gen, dtype=torch.float64) for _ in "kv")
    sink = torch.randn(hq, generator=gen, dtype=torch.float64)
    scale = d**-0.5
    ref = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    i = torch.cat([torch.arange(s.start, s.stop) for s in spans])[:, None]
    j = torch.arange(S)
    hidden = (j > i) | ((j <= i - window) if window else False)
    logits = torch.einsum("bthd,bshd->bhts", ref[0], ref[1].repeat_interleave(hq // hk, 2))
    logits = (logits * scale).masked_fill(hidden, -torch.inf)
    column = ref[3][None, :, None, None].expand(B, hq, S // 2, 1)
    probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
    out_ref = torch.einsum("bhts,bshd->bthd", probs, ref[2].repeat_interleave(hq // hk, 2))
    out_ref.backward(dout)

    q, k, v, dout = (t.to(device, dtype) for t in (q, k, v, dout))
    sink = sink.to(device, dtype)
    attn = ChunkedKernel(kernel, scale, window)
    out, lse = chunked_attention_forward(attn, q, spans, (k, v))
    out, lse = add_sink(out, lse, sink)
    dq, dk, dv = chunked_attention_backward(attn, dout, q, spans, kv=(k, v), fwd=(out, lse))
    ds = sink_grad(dout.transpose(1, 2), out.transpose(1, 2), lse, sink)
    got = dict(out=out, dq=dq, dk=dk, dv=dv, dsink=ds)
    want = [out_ref.detach(), *(t.grad for t in ref)]
    return {n: rel_err(g.cpu(), w) for (n, g), w in zip(got.items(), want)}


@pytest.mark.parametrize("name", available_backends("cpu", torch.float64))
@pytest.mark.parametrize("window", [None, 37])
def test_every_cpu_kernel_with_sinks(name, window):
    errs = _kernel_errors(BACKENDS[name], torch.float64, torch.device("cpu"), window)
    assert max(errs.values()) < TOL, errs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["cuda_flash", "cuda_cudnn", "cuda_efficient", "flash_attn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 37])
def test_cuda_kernels_with_sinks(name, dtype, window):
    kernel, cuda = BACKENDS[name], torch.device("cuda")
    if not kernel.supports(cuda, dtype):
        pytest.skip(f"{name} cannot run {dtype} here")
    errs = _kernel_errors(kernel, dtype, cuda, window)
    assert max(errs.values()) < (1e-4 if dtype == torch.float32 else 3e-2), errs
