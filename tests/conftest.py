"""Shared test helpers and fixtures.

Markers: ``multiproc`` marks tests that spawn process groups (integration); ``pytest -m "not
multiproc"`` runs the fast unit tests alone. ``make test`` runs everything.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "multiproc: spawns real process groups (integration test)")
    config.addinivalue_line("markers", "cuda: needs a GPU (skipped without one; gpu_check.sh)")


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


@pytest.fixture(scope="module")
def tmp(tmp_path_factory, request) -> str:
    """A directory shared by the tests of one module (named after it)."""
    return str(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")))
