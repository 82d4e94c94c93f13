"""``benchmarks.qwen3_next`` at a tiny size: the TSP row's loss equals the single process's, a
TSP rank saves less than the single process, and DeepSpeed Ulysses, which runs the linear layers
on a rank's own tokens only, answers a different loss."""

from __future__ import annotations

import pytest

from benchmarks.qwen3_next import bench, markdown_table

pytestmark = pytest.mark.multiproc


def test_qwen3_next_rows(workers):
    rows = bench(256, [2], steps=1, baselines=("ulysses",), timeout=180, launch=workers.run)
    single, tsp, ulysses = rows
    assert [(r["path"], r["D"]) for r in rows] == [("1 process", 1), ("tsp", 2), ("ulysses", 2)]
    assert single["ok"] and tsp["ok"] and tsp["loss_ok"]
    assert abs(tsp["loss"] - single["loss"]) <= 1e-4 * abs(single["loss"])
    assert tsp["saved"] < single["saved"]
    assert ulysses["ok"] and not ulysses["loss_ok"]
    assert "(wrong)" in markdown_table(rows)
