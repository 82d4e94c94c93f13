"""The launcher's reports: a rank that crashes is named with its signal and its stack."""

from __future__ import annotations

import ctypes

import pytest
import torch.distributed as dist

from tsp_ext.testing.launch import WorkerPool

pytestmark = pytest.mark.multiproc


def _crash_on_rank0(rank: int, world: int) -> None:
    if rank == 0:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.barrier()


def _rank(rank: int, world: int) -> int:
    return rank


def test_a_crashed_rank_is_reported_with_its_stack():
    """Rank 0 segfaults while rank 1 waits on it: the report names rank 0's death by the signal
    and quotes faulthandler's stack of it (the crashing function), not only rank 1's echo; the
    pool then starts afresh."""
    pool = WorkerPool(2)
    try:
        with pytest.raises(RuntimeError) as failed:
            pool.run(_crash_on_rank0, timeout=60)
        report = str(failed.value)
        assert "rank 0 died with exit code -11" in report
        assert "Segmentation fault" in report and "_crash_on_rank0" in report
        assert pool.run(_rank, timeout=60) == [0, 1]
    finally:
        pool.close()
