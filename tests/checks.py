"""Helpers the test workers use to compare tensors and capture error messages."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of the reference ``b``."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def error_message(fn) -> str:
    """The message of the ``ValueError`` that ``fn()`` raises (for error tests inside workers)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"
