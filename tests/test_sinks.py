"""Attention sinks (gpt-oss): TSP attention against Hugging Face's ``GptOssAttention`` on the
same full sequence, training (outputs, every gradient, the sinks' included) and inference
(prefill, then decode steps), on a sliding-window layer and a full layer."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from checks import doc_positions, hf_mask, rel_err
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from tsp_ext import TSPAttention, TSPConfig, ZigzagLayout, pad_sequence, padded_length
from tsp_ext.engine.attention_backends import BACKENDS, available_backends
from tsp_ext.engine.chunked_attention import chunked_attention_backward, chunked_attention_forward
from tsp_ext.engine.lse import add_sink, sink_grad
from tsp_ext.hf.cache import TSPCacheLayer

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


def tsp_rope(rope: GptOssRotaryEmbedding, x: torch.Tensor, pos: torch.Tensor):
    """TSP's ``(cos, sin) [B, T, d]`` for positions ``pos [B, T]``: gpt-oss's rotary tables are
    ``[B, T, d/2]``, applied to the halves of a head, the same as rotate-half RoPE with each
    table repeated."""
    return tuple(torch.cat([t, t], dim=-1) for t in rope(x, pos))


def _training_case(rank, world, layer, B, S, docs=None) -> dict:
    """One causal stream of S tokens, or (``docs``: each row's document lengths) packed rows."""
    cfg = make_config()
    attn, rope = hf_layer(cfg, layer), GptOssRotaryEmbedding(cfg)
    torch.manual_seed(100 + S)
    x = torch.randn(B, S, cfg.hidden_size, dtype=torch.float64)
    dy = torch.randn_like(x)
    full_pos = torch.arange(S).expand(B, S) if docs is None else doc_positions(docs)
    xr = x.clone().requires_grad_()
    yr, _ = attn(xr, rope(x, full_pos), hf_mask(full_pos, attn.sliding_window))
    (yr * dy).sum().backward()

    lay = ZigzagLayout(padded_length(S, world), world)
    pos = lay.positions(rank)
    real = pos < S
    kw = {}
    if docs is not None:  # S a multiple of 2D: no padding
        pos = kw["position_ids"] = lay.shard(full_pos, rank)
    t_attn = TSPAttention.from_hf(attn, dist.group.WORLD, TSPConfig(attn_block=4))
    assert t_attn.spec.window == attn.sliding_window and t_attn.sinks is not None

    def local(t):  # this rank's real tokens of a full [B, S, ...] tensor
        return lay.shard(pad_sequence(t, world, 0.0), rank)[:, real]

    xl = lay.shard(pad_sequence(x, world, 0.0), rank).requires_grad_()
    yl, _ = t_attn(xl, position_embeddings=tsp_rope(rope, x, pos.expand(B, -1)), **kw)
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
    cfg = make_config()
    attn, rope = hf_layer(cfg, layer), GptOssRotaryEmbedding(cfg)
    L = S + DECODE_STEPS
    torch.manual_seed(200 + S)
    x = torch.randn(B, L, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        full_pos = torch.arange(L).expand(B, L)
        ref, _ = attn(x, rope(x, full_pos), hf_mask(full_pos, attn.sliding_window))
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
        out[("packed", layer, 48)] = _training_case(rank, world, layer, 2, 48, PACKED)
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
    out, lse = chunked_attention_forward(kernel, q, spans, k, v, scale, window)
    out, lse = add_sink(out, lse, sink)
    dq, dk, dv = chunked_attention_backward(kernel, dout, q, spans, k, v, out, lse, scale, window)
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
