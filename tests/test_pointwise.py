"""The engine's pointwise maths: the training RMSNorm (the taped one's values and gradients —
float64 to the bit, fused float32/bf16 within rounding — at half its saved bytes) and RoPE on
interleaved head dims (Hugging Face's rotation, as one complex multiply)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tsp_ext.engine.attention.qkv import deinterleave_heads, interleave_heads
from tsp_ext.engine.kernels import pointwise
from tsp_ext.engine.kernels.pointwise import (
    add_matmul,
    matmul,
    rms_norm,
    rms_norm_keeping_input,
    rope,
    rope_phases,
)
from tsp_ext.memory import SavedTensorBytes

# relative to the largest gradient: float64 replays the taped order; others are fused (rounding)
GRAD_TOL = {torch.float64: 0.0, torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 72])
def test_rms_norm_keeping_input_matches_the_taped_norm(dtype, width):
    torch.manual_seed(0)
    x = torch.randn(2, 5, width, dtype=dtype, requires_grad=True)
    w = torch.randn(width, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 5, width, dtype=dtype)
    with SavedTensorBytes(ignore=[w]) as taped_saved:
        taped = rms_norm(x, w, 1e-6)
    with SavedTensorBytes(ignore=[w]) as lean_saved:
        lean = rms_norm_keeping_input(x, w, 1e-6)
    assert torch.equal(lean, taped)
    for got, want in zip(
        torch.autograd.grad(lean, [x, w], dy), torch.autograd.grad(taped, [x, w], dy)
    ):
        err = (got.double() - want.double()).abs().max() / want.double().abs().max()
        assert err <= GRAD_TOL[dtype], (dtype, err.item())
    # kept: x and one float32 per row; the taped norm also keeps x̂ (and a float32 copy of a
    # half-precision or float64 x)
    assert lean_saved.nbytes == x.nbytes + 2 * 5 * 4
    assert taped_saved.nbytes - lean_saved.nbytes >= x.numel() * min(x.element_size(), 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_offset_rms_norm_is_gemmas(dtype):
    """With ``offset=1``: Gemma's ``x̂ · (1 + w)`` in float32, cast last — its values to the bit
    and its gradients (float64: replayed in its order, to float32 rounding of the weight's sum;
    float32 / bf16 fused)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(0)
    hf = GemmaRMSNorm(72, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.normal_()
    x = torch.randn(2, 5, 72, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 5, 72, dtype=dtype)
    lean = rms_norm_keeping_input(x, hf.weight, 1e-6, offset=1.0)
    assert torch.equal(lean, hf(x))
    got = torch.autograd.grad(lean, [x, hf.weight], dy)
    want = torch.autograd.grad(hf(x), [x, hf.weight], dy)
    tol = {torch.float64: 1e-7, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for g, w in zip(got, want):
        assert (g.double() - w.double()).abs().max() / w.double().abs().max() <= tol
    if dtype == torch.float64:
        assert torch.equal(got[0], want[0])  # dx replays the taped order


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_gate_activation_backward_is_autograds(kind):
    from transformers.activations import ACT2FN

    hf = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[kind]
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 9, dtype=torch.float64)
    y = ACT2FN[hf](x)
    assert torch.equal(pointwise.gate_activation(x.detach(), kind), y)
    (want,) = torch.autograd.grad(y, x, g)
    got = pointwise.gate_activation_backward(g, x.detach(), kind, torch.empty_like(g))
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_on_interleaved_heads_is_hugging_faces_rope(dtype):
    """``rope`` on interleaved head dims, de-interleaved, equals HF's rotate_half RoPE; the
    conjugate phases undo it; and the dot products attention takes are the same."""
    torch.manual_seed(0)
    B, T, H, d = 2, 7, 3, 8
    q, k = (torch.randn(B, T, H, d, dtype=torch.float64) for _ in "qk")
    angles = torch.randn(B, T, d // 2, dtype=torch.float64)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)

    def heads(t, fn):  # per-head row permutation applied along the last dim
        return fn(t.reshape(-1, d).t(), d).t().reshape(t.shape)

    phases = rope_phases(cos.to(dtype), sin.to(dtype), dtype)
    got_q = rope(heads(q, interleave_heads).to(dtype), phases)
    got_k = rope(heads(k, interleave_heads).to(dtype), phases)
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(heads(got_q.double(), deinterleave_heads), want_q, atol=tol, rtol=0)
    scores = torch.einsum("bthd,bshd->bhts", got_q.double(), got_k.double())
    torch.testing.assert_close(
        scores, torch.einsum("bthd,bshd->bhts", want_q, want_k), atol=tol * 10, rtol=tol
    )
    back = rope(got_q, phases.conj().resolve_conj())
    torch.testing.assert_close(heads(back.double(), deinterleave_heads), q, atol=tol * 4, rtol=0)


def test_rope_tables_with_different_halves_are_refused():
    cos, sin = torch.rand(1, 4, 8), torch.rand(1, 4, 8)
    with pytest.raises(ValueError, match="halves differ"):
        rope_phases(cos, sin, torch.float32)


def _bf16_pair(device):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=gen), torch.randn(96, 40, generator=gen)
    return a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)


def test_bf16_matmuls_into_float32_are_formed_at_float32():
    """The weight-gradient GEMMs of a bf16 model: a float32 result, never a bf16-rounded one."""
    a, b = _bf16_pair("cpu")
    exact = a.float() @ b.float()
    assert torch.equal(matmul(a, b, torch.float32), exact)
    out = torch.empty(64, 40)
    assert matmul(a, b, torch.float32, out=out) is out and torch.equal(out, exact)
    acc = torch.ones(64, 40)
    add_matmul(acc, a, b)
    torch.testing.assert_close(acc, exact + 1, rtol=0, atol=1e-5)
    assert torch.equal(matmul(a, b, torch.bfloat16), a @ b)


def test_bf16_matmuls_take_the_out_dtype_op_on_meta():
    """Meta runs the branch CUDA takes (``mm(..., out_dtype=float32)``): shapes and dtypes."""
    a, b = _bf16_pair("meta")
    out = torch.empty(64, 40, device="meta")
    assert matmul(a, b, torch.float32, out=out) is out
    acc = torch.empty(64, 40, device="meta")
    add_matmul(acc, a, b)
    assert matmul(a, b, torch.float32).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_matmuls_into_float32_on_cuda():
    a, b = _bf16_pair("cuda")
    exact = a.double() @ b.double()
    got = matmul(a, b, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    acc = torch.ones(64, 40, device="cuda")
    add_matmul(acc, a, b)
    torch.testing.assert_close(acc.double(), exact + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_row_tiles_is_the_untiled_norm(dtype, monkeypatch):
    """Rows in tiles (3 rows at a time, 10 rows): values and the input gradient row by row as
    untiled, the weight gradient summed over the tiles in float32."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24, dtype=dtype, requires_grad=True)
    w = torch.randn(24, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 5, 24, dtype=dtype)

    def run():
        y = rms_norm_keeping_input(x, w, 1e-6)
        return (y, *torch.autograd.grad(y, [x, w], dy))

    whole = run()
    monkeypatch.setattr(pointwise, "NORM_ROWS", 3)
    tiled = run()
    assert torch.equal(tiled[0], whole[0]) and torch.equal(tiled[1], whole[1])
    torch.testing.assert_close(tiled[2], whole[2], rtol=GRAD_TOL[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_rows_rebuild_the_normed_input_a_tile_at_a_time(dtype, monkeypatch):
    """``TokenRows`` of a norm's input (tiles of 3 of 10 rows): its projection and weight
    gradient are those of the whole normed input, and no tile is wider than 3 rows."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24, dtype=dtype)
    w, proj, d = (torch.randn(*s, dtype=dtype) for s in ((24,), (7, 24), (10, 7)))
    normed = rms_norm_keeping_input(x, w, 1e-6)
    saved = pointwise.to_save(normed)
    assert saved[0] is x
    monkeypatch.setattr(pointwise, "NORM_MIN_ROWS", 3)
    monkeypatch.setattr(pointwise, "NORM_ROWS", 3)
    rows = pointwise.TokenRows(*saved)
    assert [r.stop - r.start for r, _ in rows._blocks()] == [3, 3, 3, 1]
    assert torch.equal(rows.full(), normed)
    torch.testing.assert_close(rows.linear(proj), normed @ proj.t(), rtol=1e-12, atol=1e-6)
    torch.testing.assert_close(
        rows.grad_weight(d, dtype), d.t() @ normed.view(10, 24), rtol=1e-12, atol=1e-5
    )
    plain = pointwise.TokenRows.of(normed)  # a tensor: read whole, no rebuild
    assert plain.linear(proj).shape == (2, 5, 7) and pointwise.TokenRows.of(plain) is plain


def test_merge_into_is_the_log_sum_exp_merge():
    """``lse.merge_into`` (in place, lse laid out ``[B, H, r]``) gives ``merge_partials``'s
    output and log-sum-exp, from an empty running state through two partials."""
    from tsp_ext.engine.kernels.lse import merge_into, merge_partials

    torch.manual_seed(0)
    parts = [(torch.randn(2, 6, 3, 4), torch.randn(2, 3, 6)) for _ in range(2)]
    out, lse = torch.zeros(2, 6, 3, 4), torch.full((2, 3, 6), float("-inf"))
    for o, l in parts:
        merge_into(out, lse, o, l)
    want, want_lse = merge_partials([(o, l.transpose(1, 2)) for o, l in parts])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.transpose(1, 2))
