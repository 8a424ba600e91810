"""BlockManager: block counts at exact block boundaries, append, slots, free-count restore."""

import pytest

from tpengine.engine.block_manager import BlockManager
from tpengine.engine.sampling_params import SamplingParams
from tpengine.engine.sequence import Sequence


def make_seq(seq_id: int, n: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(range(1, n + 1)), SamplingParams())


@pytest.mark.parametrize("n", range(1, 14))
def test_allocate_block_counts_at_boundaries(n):
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, n)
    expected = (n + 3) // 4  # 1..4 -> 1, 5..8 -> 2, 9..12 -> 3, 13 -> 4
    assert seq.num_blocks(4) == expected
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == expected
    assert bm.num_free_blocks == 8 - expected
    # simulate decode: each appended token needs a new block exactly when num_tokens % 4 == 1
    for _ in range(6):
        seq.append_token(7)
        before = bm.num_free_blocks
        assert bm.can_append(seq)
        bm.may_append(seq)
        grew = seq.num_tokens % 4 == 1
        assert bm.num_free_blocks == before - (1 if grew else 0)
        assert len(seq.block_table) == (seq.num_tokens + 3) // 4
    bm.deallocate(seq)
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 8


def test_slots_are_unique_and_follow_block_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(0, 5), make_seq(1, 9)
    bm.allocate(a)
    bm.allocate(b)
    assert bm.num_free_blocks == 1
    slots = bm.slots(a, 0, 5) + bm.slots(b, 0, 9)
    assert len(set(slots)) == 14
    assert bm.slot(a, 4) == a.block_table[1] * 4 + 0
    assert bm.slot(b, 7) == b.block_table[1] * 4 + 3
    with pytest.raises(IndexError):
        bm.slot(a, 8)


def test_errors_and_exhaustion():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = make_seq(0, 9)
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(big)
    assert bm.num_free_blocks == 2  # failed allocation takes nothing
    s = make_seq(1, 8)
    bm.allocate(s)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(s)
    s.append_token(3)  # 9 tokens: needs a third block, none free
    assert not bm.can_append(s)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.may_append(s)
    with pytest.raises(RuntimeError, match="allocate"):
        bm.may_append(make_seq(2, 1))
    table = list(s.block_table)
    bm.deallocate(s)
    s.block_table = table
    with pytest.raises(RuntimeError, match="not allocated"):
        bm.deallocate(s)  # double free is caught
    with pytest.raises(ValueError):
        BlockManager(0, 4)
