"""The engine's RMSNorm for training: the taped one's values and gradients (float64 to the bit,
fused float32/bf16 within rounding), half its saved bytes."""

from __future__ import annotations

import pytest
import torch

from tsp_ext.engine.pointwise import rms_norm, rms_norm_keeping_input
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
