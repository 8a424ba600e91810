"""BlockManager: block counts at exact block boundaries, append, slots, free-count restore."""

import pytest

from tpengine.engine.block_manager import BlockManager
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams


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


# ---- prefix caching ------------------------------------------------------------------------------

def seq_of(seq_id: int, ids: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", ids, SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> None:
    """As after the step that computes all of ``s``'s tokens but the last one's successor."""
    s.num_cached_tokens = s.num_tokens
    bm.cache_computed(s)


def test_block_hash_is_chained_over_the_parent():
    from tpengine.engine.block_manager import ROOT_HASH, block_hash

    a = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert a == block_hash(ROOT_HASH, [1, 2, 3, 4]) and len(a) == 16
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) != block_hash(ROOT_HASH, [1, 2, 3, 5])


@pytest.mark.parametrize("n,hit_blocks", [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_full_hit_always_leaves_the_last_token_to_compute(n, hit_blocks):
    """A prompt seen before hits its whole blocks, but at most n - 1 tokens: the last prompt token is
    computed again so its logits exist."""
    bm = BlockManager(num_blocks=16, block_size=4)
    ids = list(range(100, 100 + n))
    a = seq_of(0, ids)
    assert bm.allocate(a) == 0
    computed(bm, a)
    b = seq_of(1, ids)
    assert bm.allocate(b) == hit_blocks * 4 == b.num_cached_tokens
    assert b.block_table[:hit_blocks] == a.block_table[:hit_blocks]
    assert set(b.block_table[hit_blocks:]).isdisjoint(a.block_table)
    assert [bm.ref_count[x] for x in b.block_table] == [2] * hit_blocks + [1] * (len(b.block_table) - hit_blocks)
    assert bm.num_free_blocks == 16 - len(a.block_table) - (len(b.block_table) - hit_blocks)


def test_prefix_ending_mid_block_and_divergence_in_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    base = list(range(1, 11))  # 10 tokens: blocks [1-4] [5-8], partial [9 10]
    a = seq_of(0, base)
    bm.allocate(a)
    computed(bm, a)
    mid = seq_of(1, base[:6] + [77, 78, 79])  # shares 6 tokens: only the first whole block
    assert bm.allocate(mid) == 4 and mid.block_table[0] == a.block_table[0]
    last = seq_of(2, base[:7] + [99])  # 8 tokens, differs in its last: block 2 differs
    assert bm.allocate(last) == 4 and last.block_table[1] != a.block_table[1]
    same8 = seq_of(3, base[:8] + [55])  # 9 tokens: both whole blocks shared
    assert bm.allocate(same8) == 8 and same8.block_table[:2] == a.block_table[:2]
    # the partly filled block [9 10] is never shared, even for the very same prompt
    again = seq_of(4, base + [11, 12])
    assert bm.allocate(again) == 8 and again.block_table[2] != a.block_table[2]


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq_of(0, [1, 2, 3, 4, 5]), seq_of(1, [11, 12, 13, 14, 15])
    for s in (a, b):
        bm.allocate(s)
        computed(bm, s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4  # 2 full blocks each
    # a was freed first, so its blocks go first, its partial tail block before its prefix blocks
    c = seq_of(2, [21, 22, 23, 24, 25])
    bm.allocate(c)
    assert c.block_table == a_blocks[::-1] and bm.num_evictions == 2 and bm.num_cached_blocks == 2
    hits_b = seq_of(3, [11, 12, 13, 14, 99])
    assert bm.allocate(hits_b) == 4 and hits_b.block_table[:2] == b_blocks[:2]  # b's prefix survived
    bm.deallocate(c)
    bm.deallocate(hits_b)
    assert bm.num_free_blocks == 6


def test_eviction_order_and_counts():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq_of(0, [1, 2, 3, 4, 5])  # blocks: [1 2] [3 4] [5]
    bm.allocate(a)
    computed(bm, a)
    first, second, tail = a.block_table
    bm.deallocate(a)  # queue (LRU first): never-used block, then a's tail, second, first
    assert bm.num_cached_blocks == 2
    x = seq_of(1, [9, 9, 9])  # 2 blocks: the unused one and a's tail (no cached prefix lost)
    bm.allocate(x)
    assert bm.num_evictions == 0 and tail in x.block_table and bm.num_cached_blocks == 2
    y = seq_of(2, [8, 8])  # 1 block: evicts a's second block, the first still cached
    bm.allocate(y)
    assert y.block_table == [second] and bm.num_evictions == 1 and bm.num_cached_blocks == 1
    z = seq_of(3, [1, 2, 3, 4, 7])  # [1 2] still cached, [3 4] evicted: 1 hit, 2 new blocks
    assert bm.match(z) == [first]
    assert not bm.can_allocate(z)  # the one free block is the hit itself
    with pytest.raises(RuntimeError, match="needs 2 more block"):
        bm.allocate(z)
    assert bm.num_free_blocks == 1 and z.block_table == []  # a failed allocation takes nothing
    bm.deallocate(y)
    bm.deallocate(x)
    assert bm.allocate(z) == 2 and z.block_table[0] == first and bm.ref_count[first] == 1


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq_of(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    b = seq_of(1, [1, 2, 3, 4, 5])
    assert bm.allocate(b) == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_cached_blocks == 0 and bm.cached == {}


def test_reset_prefix_cache_forgets_free_and_used_blocks_contents_stay_owned():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq_of(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    b = seq_of(1, [1, 2, 3, 4, 9])
    bm.allocate(b)
    computed(bm, b)
    bm.deallocate(a)
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0
    assert bm.allocate(seq_of(2, [1, 2, 3, 4, 5])) == 0  # nothing shared any more
    assert bm.ref_count[b.block_table[0]] == 1  # b still owns its blocks
    bm.deallocate(b)
