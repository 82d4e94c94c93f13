"""``benchmarks.gpt_oss`` at a tiny size: the TSP row's loss equals the single process's, a TSP
rank saves less than the single process, and torch's ring context parallelism, which runs on
gpt-oss's eager attention without exchanging anything, answers a different loss."""

from __future__ import annotations

import pytest

from benchmarks.gpt_oss import bench, markdown_table

pytestmark = pytest.mark.multiproc


def test_gpt_oss_rows(workers):
    rows = bench(256, [2], steps=1, baselines=("ring",), timeout=180, launch=workers.run)
    single, tsp, ring = rows
    assert [(r["path"], r["D"]) for r in rows] == [("1 process", 1), ("tsp", 2), ("ring", 2)]
    assert single["ok"] and tsp["ok"] and tsp["loss_ok"]
    assert abs(tsp["loss"] - single["loss"]) <= 1e-4 * abs(single["loss"])
    assert tsp["saved"] < single["saved"]
    assert ring["ok"] and not ring["loss_ok"]
    assert abs(ring["loss"] - single["loss"]) > 1e-3
    assert "(wrong)" in markdown_table(rows)
