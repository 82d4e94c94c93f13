"""Shared fixtures.

Markers: ``multiproc`` marks tests that spawn process groups (integration); ``pytest -m "not
multiproc"`` runs the fast unit tests alone. ``make test`` runs everything.
"""

from __future__ import annotations

import pytest

from tsp_ext.testing.launch import WorkerPools


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "multiproc: spawns real process groups (integration test)")
    config.addinivalue_line("markers", "cuda: needs a GPU (skipped without one; gpu_check.sh)")


@pytest.fixture(scope="session")
def workers():
    """Gloo ranks kept for the whole session, one group per world size: ``workers.run(fn, world,
    *args, timeout=...)`` runs ``fn(rank, world, *args)`` on each rank as ``run_processes`` does,
    without starting processes for every test (a hang or an error still fails the test, with the
    ranks' tracebacks or stack dumps, and restarts that group)."""
    pools = WorkerPools()
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory, request) -> str:
    """A directory shared by the tests of one module (named after it)."""
    return str(tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_")))
