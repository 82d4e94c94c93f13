"""``benchmarks.vision`` at a tiny size: the TSP rows' losses equal the single process's, a TSP
rank saves less than the single process (the vision tower's part too), and torch's ring
context parallelism, which does not run on a vision-language model, says why in its row."""

from __future__ import annotations

import pytest

from benchmarks.vision import bench, markdown_table

pytestmark = pytest.mark.multiproc


def test_vision_rows(workers):
    rows = bench((8, 8, 48), [2], steps=1, baselines=("ring",), timeout=180, launch=workers.run)
    single, tsp, ring = rows
    assert [(r["path"], r["D"]) for r in rows] == [("1 process", 1), ("tsp", 2), ("ring", 2)]
    assert single["ok"] and tsp["ok"]
    assert abs(tsp["loss"] - single["loss"]) <= 1e-4 * abs(single["loss"])
    assert tsp["saved"] < single["saved"]
    assert 0 < tsp["vision_saved"] < single["vision_saved"]
    assert not ring["ok"]
    assert ring["error"].startswith("ValueError: Video features and video tokens do not match")
    assert "does not run" in markdown_table(rows)
