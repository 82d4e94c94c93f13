"""Chunked causal attention on every local kernel backend vs a dense softmax reference."""

from __future__ import annotations

import pytest
import torch

from tsp_ext.engine.attention.kv_exchange import heads_major
from tsp_ext.engine.kernels.backends import (
    BACKENDS,
    _aligns_bottom_right,
    available_backends,
    select_backend,
)
from tsp_ext.engine.kernels.chunked import (
    ChunkedKernel,
    chunked_attention_backward,
    chunked_attention_forward,
)
from tsp_ext.engine.sharding.layout import Span, ZigzagLayout

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}


def _dense(q, q_pos, k, v, scale):
    """Explicit softmax; query at global position p sees keys 0..p (k, v in natural order)."""
    g = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kx) * scale
    mask = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), vx), lse


def _spans(S: int, D: int, p: int) -> list[Span]:
    return list(ZigzagLayout(S, D).spans(p))


def _inputs(B, S, T, hq, hk, d, dtype, device=CPU, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)

    return r(B, T, hq, d), r(B, S, hk, d), r(B, S, hk, d), r(B, T, hq, d)


def _check_parity(kernel, spans, S, hq, hk, d, dtype, device=CPU, heads_first=False):
    """``heads_first``: q, k, v, dout stored ``[B, H, L, d]`` (views ``[B, L, H, d]``), as the TSP
    schedule hands them to the kernels; out then comes back in that layout too."""
    B, T = 2, sum(s.length for s in spans)
    q, k, v, dout = _inputs(B, S, T, hq, hk, d, dtype, device)
    if heads_first:
        q, k, v, dout = map(heads_major, (q, k, v, dout))
    scale = d**-0.5
    attn = ChunkedKernel(kernel, scale)
    out, lse = chunked_attention_forward(attn, q, spans, (k, v))
    dq, dk, dv = chunked_attention_backward(attn, dout, q, spans, kv=(k, v), fwd=(out, lse))

    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    qr, kr, vr = (t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v))
    q_pos = torch.cat([torch.arange(s.start, s.stop, device=device) for s in spans])
    out_ref, lse_ref = _dense(qr, q_pos, kr, vr, scale)
    out_ref.backward(dout.to(ref_dtype))

    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == ref_dtype and lse.shape == (B, hq, T)
    assert dq.dtype == q.dtype and dk.dtype == dv.dtype == ref_dtype
    assert dk.shape == k.shape and dv.shape == v.shape
    tol = TOL[dtype] if device.type == "cpu" or dtype != torch.float32 else 1e-4
    for got, want in [(out, out_ref), (lse, lse_ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)]:
        torch.testing.assert_close(got.to(ref_dtype), want.detach(), rtol=tol, atol=tol)


LOCAL = [n for n in ("cpu_flash", "blockwise") if n in available_backends(CPU, torch.float32)]
LAYOUTS = [(64, 2, 0), (64, 2, 1), (64, 4, 0), (64, 4, 3), (64, 1, 0)]  # (S, D, rank)
HEADS = [(4, 4), (4, 2), (4, 1)]


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("S,D,p", LAYOUTS)
@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_matches_dense(name, S, D, p, hq, hk, d, dtype):
    kernel = BACKENDS[name]
    if not kernel.supports(CPU, dtype):
        pytest.skip(f"{name} does not take {dtype}")
    _check_parity(kernel, _spans(S, D, p), S, hq, hk, d, dtype)


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("heads_first", [False, True])
def test_odd_spans_and_empty(name, heads_first):
    """Spans in any row order, of unequal length, one empty, one ending at S."""
    spans = [Span(0, 40, 24), Span(24, 0, 5), Span(29, 5, 0), Span(29, 17, 11)]
    _check_parity(BACKENDS[name], spans, 64, 4, 2, 16, torch.float64, heads_first=heads_first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alignment_probe_tells_bottom_right_from_top_left(dtype):
    """The probe the fused CUDA kernels run once: blockwise aligns a short causal query block with
    the end of its keys (one call per chunk), the CPU flash op with the start (two calls)."""
    assert _aligns_bottom_right(BACKENDS["blockwise"], CPU, dtype)
    assert not _aligns_bottom_right(BACKENDS["cpu_flash"], CPU, dtype)
    assert BACKENDS["blockwise"].one_call_causal(CPU, dtype)
    assert not BACKENDS["cpu_flash"].one_call_causal(CPU, dtype)
    assert not BACKENDS["cuda_flash"].one_call_causal(torch.device("meta"), dtype)


def test_cpu_flash_bf16_close_to_blockwise():
    spans = _spans(64, 2, 0)
    _check_parity(BACKENDS["cpu_flash"], spans, 64, 4, 2, 32, torch.bfloat16)


def test_select_backend_auto():
    assert select_backend("auto", "cpu", torch.float32).name == "cpu_flash"
    assert select_backend("auto", "cpu", torch.float64).name == "cpu_flash"
    assert select_backend("auto", "meta", torch.float32).name == "blockwise"
    cuda = select_backend("auto", "cuda", torch.float32).name
    assert cuda == ("cuda_efficient" if torch.backends.cuda.is_built() else "blockwise")
    assert select_backend("blockwise", "cpu", torch.float64).name == "blockwise"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_select_backend_auto_cuda_half():
    """cuDNN where SDPA itself would take it (capability >= 9.0) and the shapes repeat; a
    FlashAttention kernel for varying shapes (packed documents, inference) and large heads."""
    bf16 = torch.bfloat16
    flash = "flash_attn" if BACKENDS["flash_attn"].installed() else "cuda_flash"
    hopper = "cuda_cudnn" in available_backends("cuda", bf16)
    hopper = hopper and torch.cuda.get_device_capability() >= (9, 0)
    assert select_backend("auto", "cuda", bf16, head_dim=128).name == (
        "cuda_cudnn" if hopper else flash
    )
    assert select_backend("auto", "cuda", bf16, head_dim=128, repeating_shapes=False).name == flash
    assert select_backend("auto", "cuda", bf16, head_dim=256).name == flash


def test_select_backend_errors():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend("nope", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"cannot run on cpu .*backends that can: \['cpu_flash'"):
        select_backend("cuda_efficient", "cpu", torch.float32)
    with pytest.raises(ValueError, match="cannot run on cuda"):
        select_backend("cuda_flash", "cuda", torch.float32)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        select_backend("cpu_flash", "cpu", torch.int32)


def test_span_outside_keys_rejected():
    q, k, v, _ = _inputs(1, 16, 8, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        chunked_attention_forward(
            ChunkedKernel(BACKENDS["blockwise"], 0.25), q, [Span(0, 12, 8)], (k, v)
        )


CUDA_BACKENDS = ["cuda_flash", "cuda_cudnn", "cuda_efficient", "flash_attn"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_cuda_backends(name, dtype, hq, hk, heads_first):
    cuda = torch.device("cuda")
    kernel = BACKENDS[name]
    if not kernel.supports(cuda, dtype):
        pytest.skip(f"{name} cannot run {dtype} here")
    for S, D, p in [(256, 2, 0), (256, 4, 1)]:
        _check_parity(kernel, _spans(S, D, p), S, hq, hk, 64, dtype, cuda, heads_first)


@pytest.mark.parametrize(
    "name,dtype",
    [(n, dt) for n in ("cuda_flash", "cuda_efficient") for dt in (torch.bfloat16, torch.float32)]
    + [("cuda_cudnn", torch.bfloat16)],
)
@pytest.mark.parametrize("heads_first", [False, True])
def test_cuda_op_calls_match_schema_on_meta(name, dtype, heads_first):
    """The aten calls, argument for argument, against the ops' meta kernels: shapes and dtypes
    only, but it runs without a GPU. Token-major and heads-major storage (the schedule's)."""
    layout = heads_major if heads_first else (lambda t: t)
    q, k, v, dout = (layout(t).to("meta") for t in _inputs(2, 64, 32, 4, 2, 16, dtype))
    spans = _spans(64, 2, 1)
    attn = ChunkedKernel(BACKENDS[name], 0.25)
    out, lse = chunked_attention_forward(attn, q, spans, (k, v))
    dq, dk, dv = chunked_attention_backward(attn, dout, q, spans, kv=(k, v), fwd=(out, lse))
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
        q.shape,
        dtype,
        (2, 4, 32),
        torch.float32,
    )
    assert (dq.shape, dq.dtype, dk.shape, dv.shape) == (q.shape, dtype, k.shape, v.shape)


def test_benchmark_rows():
    from benchmarks.attention_kernels import bench, markdown_table

    rows = bench(64, 4, 2, 16, 2, repeats=1, warmup=0)
    assert [r["kernel"] for r in rows][:2] == ["blockwise", "cpu_flash"]
    assert rows[1]["max_abs_diff"] < 1e-5 and rows[0]["fwd_vs_blockwise"] == 1.0
    assert markdown_table(rows).count("\n| ") == len(rows) + 1
