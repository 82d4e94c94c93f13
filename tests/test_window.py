"""The sliding-window K/V exchange: which keys each rank receives, and that its gather and
scatter equal the all-gather and reduce-scatter restricted to those keys."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tsp_ext.engine.attention.window import WindowExchange
from tsp_ext.engine.sharding.layout import ZigzagLayout, padded_length


@pytest.mark.parametrize("S,D,W", [(64, 4, 8), (48, 3, 5), (40, 2, 3), (96, 4, 30), (24, 4, 2)])
def test_segments_hold_exactly_the_keys_each_rank_sees(S, D, W):
    layout = ZigzagLayout(S, D)
    ex = WindowExchange(layout, W)
    for p in range(D):
        needed = {j for i in layout.positions(p).tolist() for j in range(max(0, i - W + 1), i + 1)}
        got = []
        for x in (x for x in ex.pieces if x.dst == p):
            base, stop = ex.bounds[p][x.segment]
            assert base + x.dst_row == x.start and x.start + x.length <= stop
            src_positions = layout.positions(x.src)[x.src_row : x.src_row + x.length]
            assert src_positions.tolist() == list(range(x.start, x.start + x.length))
            got += range(x.start, x.start + x.length)
        assert sorted(got) == sorted(set(got))  # no key twice
        segment_keys = {j for b, e in ex.bounds[p] for j in range(b, e)}
        assert set(got) == segment_keys >= needed
        assert len(segment_keys - needed) == 0  # segments start where the window does


def test_rows_received_at_eight_windows():
    """S = 8W at D = 4 (chunks of W): a rank receives W - 1 or 2(W - 1) keys, not 3/4 of S."""
    layout = ZigzagLayout(64, 4)
    ex = WindowExchange.for_layout(layout, 8)
    assert [ex.moved_rows(p) for p in range(4)] == [7, 14, 14, 7]
    assert ex.bounds[3] == [(17, 40)]  # chunks 3 and 4 touch: one segment
    assert WindowExchange.for_layout(layout, 64) is None  # the all-gather moves no more
    assert WindowExchange.for_layout(ZigzagLayout(64, 1), 8) is None
    assert WindowExchange.for_layout(layout, None) is None


CASES = [(32, 4), (12, 5), (40, 13)]  # (S, W) at every world size


def exchange_worker(rank, world):
    group = dist.group.WORLD
    out = {}
    for S, W in CASES:
        layout = ZigzagLayout(padded_length(S, world), world)
        ex = WindowExchange(layout, W)
        torch.manual_seed(rank)
        kv = torch.randn(2, 6, layout.local_len, 4, dtype=torch.float64)
        gathered, handle = ex.gather(kv, group)
        handle.wait()
        segments = gathered.segments()
        everything = torch.empty(world, *kv.shape, dtype=kv.dtype)
        dist.all_gather_into_tensor(everything.view(-1, *kv.shape[1:]), kv, group=group)
        natural = layout.unshard(torch.cat(list(everything), dim=2), dim=2)
        out[(S, W, "gather")] = max(
            (seg - natural[:, :, b : b + seg.shape[2]]).abs().max().item() for b, seg in segments
        )
        torch.manual_seed(100 + rank)
        grads = [torch.randn_like(seg) for _, seg in segments]
        dkv, handle = ex.scatter(grads, torch.float64, group)
        handle.wait()
        full = torch.zeros_like(natural)
        for (b, seg), g in zip(segments, grads):
            full[:, :, b : b + seg.shape[2]] += g
        dist.all_reduce(full, group=group)
        out[(S, W, "scatter")] = (dkv - layout.shard(full, rank, dim=2)).abs().max().item()
    return out


@functools.cache
def exchanged(workers, world):
    return workers.run(exchange_worker, world)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gather_and_scatter_match_the_collectives(workers, world):
    for rank, errs in enumerate(exchanged(workers, world)):
        assert all(e < 1e-12 for e in errs.values()), (world, rank, errs)
