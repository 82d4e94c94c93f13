"""Zigzag layout: pure logic, no process group."""

import pytest
import torch

from tsp_ext import IGNORE_INDEX, ZigzagLayout, pad_sequence, padded_length


@pytest.mark.parametrize("D", [1, 2, 3, 4])
def test_shards_partition_and_roundtrip(D):
    lay = ZigzagLayout(8 * D, D)
    x = torch.arange(2 * 8 * D * 3).view(2, 8 * D, 3)
    shards = [lay.shard(x, p) for p in range(D)]
    assert all(s.shape == (2, 8, 3) for s in shards)
    assert torch.equal(lay.unshard(torch.cat(shards, dim=1)), x)
    pos = torch.cat([lay.positions(p) for p in range(D)])
    assert torch.equal(pos.sort().values, torch.arange(8 * D))  # every token exactly once
    for p in range(D):  # a token's position is its index in the original sequence
        assert torch.equal(lay.shard(x, p)[0, :, 0] // 3, lay.positions(p))


@pytest.mark.parametrize("D", [2, 4, 8])
def test_zigzag_balances_causal_work(D):
    lay = ZigzagLayout(16 * D, D)
    work = [int((lay.positions(p) + 1).sum()) for p in range(D)]  # keys seen under causal mask
    assert len(set(work)) == 1


def test_chunks_and_spans():
    lay = ZigzagLayout(16, 2)
    assert lay.chunk == 4 and lay.local_len == 8
    assert lay.chunks(0) == (0, 3) and lay.chunks(1) == (1, 2)
    assert [(s.offset, s.start) for s in lay.spans(1)] == [(0, 4), (4, 8)]
    assert torch.equal(
        lay.gathered_positions(),
        torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]),
    )


def test_padding():
    assert padded_length(21, 2) == 24 and padded_length(24, 2) == 24 and padded_length(1, 4) == 8
    labels = torch.ones(2, 21, dtype=torch.long)
    padded = pad_sequence(labels, 2, IGNORE_INDEX)
    assert padded.shape == (2, 24) and (padded[:, 21:] == IGNORE_INDEX).all()
    assert pad_sequence(padded, 2, 0) is padded  # aligned input: no copy


def test_bad_layouts_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 2\\*tsp_size=4"):
        ZigzagLayout(10, 2)
    with pytest.raises(ValueError, match="must be even"):
        ZigzagLayout.from_local(5, 2)
    with pytest.raises(ValueError, match="outside the TSP axis"):
        ZigzagLayout(8, 2).chunks(2)
    with pytest.raises(ValueError, match="expected 8 tokens"):
        ZigzagLayout(8, 2).shard(torch.zeros(1, 6), 0)


@pytest.mark.parametrize("D", [1, 2, 3])
def test_rank_major_grads_add_key_ranges_where_rank_major_puts_them(D):
    """``RankMajorGrads`` adds a key range's gradients, within a chunk or across chunks, into the
    rank-major rows where ``KVExchange.rank_major`` lays out the token-order sums."""
    from tsp_ext.engine.attention.kv_exchange import KVExchange, RankMajorGrads

    lay, B, hk, d = ZigzagLayout(12 * D, D), 2, 2, 3
    exchange = KVExchange(lay, None, None, torch.float64)
    grads = RankMajorGrads.zeros(lay, B, hk, d, torch.float64, "cpu")
    dk, dv = (torch.zeros(B, 12 * D, hk, d, dtype=torch.float64) for _ in "kv")
    for keys in (slice(0, 12 * D), slice(0, 6), slice(5, 6), slice(4, 12 * D - 1), slice(7, 9)):
        g = torch.randn(B, keys.stop - keys.start, hk, d, dtype=torch.float64)
        grads.add(False, keys, g)
        grads.add(True, keys, 2 * g)
        dk[:, keys] += g
        dv[:, keys] += 2 * g
    assert torch.equal(grads.buf, exchange.rank_major(dk, dv))
