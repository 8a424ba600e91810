"""A model whose every attention layer slides holds at most its window's KV blocks per sequence
(BlockManager.free_outside_window, the Scheduler's step-by-step allocation): blocks freed at the right
positions, reference counts and the prefix cache kept, forks, preemption and recompute, speculative
reservations, plans whose tables carry -1. (The engine against HF: test_sliding_window_engine.py.)"""

from collections import Counter

import pytest

from tpengine.config import EngineConfig
from tpengine.engine.block_manager import BlockManager
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.engine.step import build_plan
from tpengine.sampling_params import SamplingParams

B, W = 4, 6  # block size, window: a query at i reads keys i - 5 .. i


def seq(sid: int, n: int, base: int = 0, **params) -> Sequence:
    return Sequence(sid, f"r{sid}", [base + 1000 + sid * 50 + i for i in range(n)], SamplingParams(**params))


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """As the scheduler's postprocess after a step: ``n`` more tokens' K/V computed, full blocks registered."""
    s.num_cached_tokens += n
    bm.cache_computed(s)


def test_blocks_freed_exactly_when_they_leave_the_window():
    bm = BlockManager(num_blocks=10, block_size=B, sliding_window=W)
    s = seq(0, 30)
    bm.allocate(s)  # no num_new_tokens: all 8 blocks, as a full model's
    blocks = list(s.block_table)
    assert len(blocks) == 8 and bm.num_free_blocks == 2
    for pos in range(30):
        s.num_cached_tokens = pos
        bm.free_outside_window(s)
        gone = [j for j in range(8) if (j + 1) * B <= pos - W + 1]  # the rule
        assert s.block_table == [-1] * len(gone) + blocks[len(gone):], pos
        assert bm.first_needed_block(pos) == len(gone)
        assert bm.num_held_blocks(s) == 8 - len(gone) and bm.num_free_blocks == 2 + len(gone)
    assert bm.num_window_freed == 6  # blocks 0..5: (5 + 1) * 4 <= 29 - 6 + 1
    assert [bm.ref_count[b] for b in blocks] == [0] * 6 + [1, 1]
    with pytest.raises(IndexError, match="freed"):
        bm.slot(s, 3)
    assert bm.slot(s, 29) == blocks[7] * B + 1
    bm.deallocate(s)  # -1 entries hold nothing
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_no_window_frees_nothing():
    bm = BlockManager(num_blocks=10, block_size=B)  # a mixed model (Gemma 2): sliding_window None
    s = seq(0, 30)
    bm.allocate(s, num_new_tokens=5)  # all blocks all the same
    s.num_cached_tokens = 29
    assert bm.free_outside_window(s) == 0 and bm.num_held_blocks(s) == 8 and bm.window_blocks is None


def test_prefix_cache_reference_counts_and_hits_before_the_window():
    bm = BlockManager(num_blocks=12, block_size=B, sliding_window=W)
    a = seq(0, 18)
    bm.allocate(a)
    computed(bm, a, 17)  # blocks 0..3 full and registered
    ab = list(a.block_table)
    assert all(bm.hash_of[b] is not None for b in ab[:4])
    b = Sequence(1, "r1", a.token_ids[:16] + [7, 8, 9, 10, 11, 12], SamplingParams())
    assert bm.match(b) == ab[:4]
    bm.allocate(b, num_new_tokens=6)
    # its first computed position is 16: blocks before (16 - 6 + 1) // 4 = 2 are not taken
    assert b.num_cached_tokens == 16 and b.block_table[:4] == [-1, -1, ab[2], ab[3]]
    assert len(b.block_table) == 6 and [bm.ref_count[x] for x in ab[:4]] == [1, 1, 2, 2]
    # a frees its window's leavers: a block b shares stays referenced, the others join the free queue cached
    a.num_cached_tokens = 17  # first needed block (17 - 5) // 4 = 3
    assert bm.free_outside_window(a) == 3
    assert [bm.ref_count[x] for x in ab[:4]] == [0, 0, 1, 2]
    assert bm.num_cached_blocks == 2 and bm.cached[bm.hash_of[ab[0]]] == ab[0]
    computed(bm, b, 6)  # 22 tokens: its own block 4 registered, the -1 entries skipped
    assert bm.hash_of[b.block_table[4]] == bm.hashes(b)[4] and b.num_registered_blocks == 5
    assert bm.free_outside_window(b) == 2  # blocks 2, 3: (22 - 5) // 4 = 4
    assert [bm.ref_count[x] for x in ab[:4]] == [0, 0, 0, 1] and bm.num_cached_blocks == 3
    # a third sequence still hits the whole chain (the freed blocks keep their hashes until evicted)
    c = Sequence(2, "r2", a.token_ids[:17], SamplingParams())
    assert bm.match(c) == ab[:4]
    for s in (a, b):
        bm.deallocate(s)
    assert bm.num_free_blocks == 12 and all(n == 0 for n in bm.ref_count)


def test_fork_shares_the_window_and_keeps_the_minus_ones():
    bm = BlockManager(num_blocks=12, block_size=B, sliding_window=W)
    p = seq(0, 18)
    bm.allocate(p)
    computed(bm, p, 17)
    p.append_token(5)
    p.num_cached_tokens = 18
    bm.free_outside_window(p)
    assert p.block_table[:3] == [-1, -1, -1]
    child = Sequence(1, "r0", p.token_ids[:18], SamplingParams())
    bm.fork(p, child)
    assert child.block_table == p.block_table
    assert [bm.ref_count[x] for x in p.block_table[3:]] == [2, 2]
    copies = bm.may_append(child)  # its next token goes into the shared partial block 4: copied first
    assert copies == [(p.block_table[4], child.block_table[4])] and child.block_table[:4] == p.block_table[:4]
    bm.deallocate(p)
    bm.deallocate(child)
    assert bm.num_free_blocks == 12


def cfg(**kw) -> EngineConfig:
    base = dict(block_size=B, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=200)
    return EngineConfig(**{**base, **kw})


def fake(s: Sequence) -> int:
    """Deterministic 'model': the token at position p of seq s is s.seq_id * 1000 + p."""
    return s.seq_id * 1000 + s.num_tokens


def step(sched: Scheduler, peak: Counter) -> list[Sequence]:
    """One step with the sliding invariants: each scheduled sequence's table holds exactly the blocks from
    its first computed position's window to its last computed token, each holder counted once, nothing
    leaked. ``peak[seq_id]``: the most blocks it held."""
    bm = sched.block_manager
    batch, _ = sched.schedule()
    for s in batch:
        lo, end = bm.first_needed_block(s.num_cached_tokens), s.num_cached_tokens + s.num_new_tokens
        assert s.block_table[:lo] == [-1] * lo and all(b >= 0 for b in s.block_table[lo:]), s
        assert len(s.block_table) == -(-end // B), s
        peak[s.seq_id] = max(peak[s.seq_id], bm.num_held_blocks(s))
    held = Counter(b for s in sched.running for b in s.block_table if b >= 0)
    assert all(bm.ref_count[b] == n for b, n in held.items())
    assert len(held) + bm.num_free_blocks == bm.num_blocks
    plan = build_plan(batch, True, B, 0)
    assert int(plan.slot_mapping.min()) >= 0  # never a slot in a freed block
    return sched.postprocess(batch, [fake(s) for s in batch], [False] * len(batch))


def drain(sched: Scheduler, peak: Counter, steps: int = 2000) -> None:
    for _ in range(steps):
        if not sched.has_unfinished:
            return
        step(sched, peak)
    raise AssertionError("did not drain")


def test_long_generation_in_a_cache_smaller_than_the_sequence():
    """One sequence of 10 + 100 tokens in 5 blocks (it would need 28): no preemption, at most
    ceil(6 / 4) + 1 = 3 blocks held once decoding, every token the fake model's, all blocks back."""
    sched = Scheduler(cfg(), num_kv_blocks=5, eos_token_ids=set(), sliding_window=W)
    assert sched.block_manager.window_blocks == 3
    s = seq(0, 10, max_tokens=100, ignore_eos=True)
    sched.add(s)
    peak = Counter()
    drain(sched, peak)
    assert (s.finish_reason, s.num_completion_tokens, sched.num_preemptions) == ("length", 100, 0)
    assert s.completion_token_ids == [10 + i for i in range(100)]
    assert peak[0] == 3  # the prompt's chunks of 8: blocks 0, 1 then 1, 2; decodes: 3
    assert sched.block_manager.num_window_freed == 27 - 2 and sched.block_manager.num_free_blocks == 5


def test_add_counts_the_window_not_the_prompt():
    sched = Scheduler(cfg(), num_kv_blocks=3, eos_token_ids=set(), sliding_window=W)
    sched.add(seq(0, 40))  # 10 blocks of prompt, but chunks need 3 at most
    tiny = Scheduler(cfg(), num_kv_blocks=2, eos_token_ids=set(), sliding_window=W)
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        tiny.add(seq(1, 40))
    whole = Scheduler(cfg(enable_chunked_prefill=False, max_num_batched_tokens=200), num_kv_blocks=3,
                      eos_token_ids=set(), sliding_window=W)
    with pytest.raises(ValueError, match="needs 10 KV blocks"):  # prefilled in one step: every block
        whole.add(seq(2, 40))


def test_more_sequences_fit_and_preemption_recomputes():
    """Eight sequences of prompts up to 23 tokens generating 30 each in 10 blocks: at most 3 blocks each
    while decoding, some preempted (and re-prefilled in chunks past what the cache could hold whole),
    every token the fake model's, nothing leaked; prefix caching on, two prompts sharing a prefix."""
    sched = Scheduler(cfg(max_num_seqs=8), num_kv_blocks=10, eos_token_ids=set(), sliding_window=W)
    seqs = [seq(i, 7 + 2 * i, max_tokens=30, ignore_eos=True) for i in range(8)]
    seqs[5].token_ids[:12] = seqs[4].token_ids[:12]  # a shared prefix: three blocks
    for s in seqs:
        sched.add(s)
    peak = Counter()
    drain(sched, peak)
    for s in seqs:
        assert (s.finish_reason, s.num_completion_tokens) == ("length", 30), s
        assert s.completion_token_ids == [s.seq_id * 1000 + s.num_prompt_tokens + i for i in range(30)]
        assert s.block_table == [] and s.status is SequenceStatus.FINISHED
    assert sched.num_preemptions > 0
    assert max(s.num_tokens for s in seqs) > 10 * B  # a sequence longer than the whole cache
    bm = sched.block_manager
    assert bm.num_free_blocks == 10 and all(n == 0 for n in bm.ref_count)


def test_speculative_reservation_and_trim_never_bring_freed_blocks_back():
    sched = Scheduler(cfg(), num_kv_blocks=8, eos_token_ids=set(), sliding_window=W)
    bm = sched.block_manager
    s = seq(0, 14, max_tokens=50, ignore_eos=True)
    sched.add(s)
    peak = Counter()
    while s.num_completion_tokens < 3:
        step(sched, peak)
    batch, _ = sched.schedule()  # a decode at position 16: blocks before (16 - 5) // 4 = 2 freed
    assert batch == [s] and s.num_cached_tokens == 16 and s.block_table[:2] == [-1, -1]
    assert sched.reserve_proposal(s, [1, 2, 3, 4, 5, 6])  # positions 16..22: blocks 4, 5 more
    assert len(s.block_table) == 6 and bm.num_held_blocks(s) == 4
    s.append_token(fake(s))  # the verification took only the first token: back to 18 tokens
    s.num_cached_tokens = s.num_tokens - 1
    s.proposal, s.num_new_tokens = [], 0
    assert bm.trim(s) == 1  # block 5 held only rejected positions
    assert s.block_table[:2] == [-1, -1] and len(s.block_table) == 5
    batch, _ = sched.schedule()  # the decode at 17: block 2 left the window too, (17 - 5) // 4 = 3
    assert batch == [s] and s.num_cached_tokens == 17
    assert s.block_table[:3] == [-1, -1, -1] and len(s.block_table) == 5 and bm.num_held_blocks(s) == 2


@pytest.mark.parametrize("windows, expect", [([8, 8], 8), ([4, 8, 6], 8), ([8, None], None), ([None, None], None)])
def test_kv_window_is_the_largest_when_every_layer_slides(windows, expect):
    from types import SimpleNamespace

    from tpengine.engine.model_runner import ModelRunner

    runner = SimpleNamespace(attn_modules=[SimpleNamespace(sliding_window=w) for w in windows],
                             tp=SimpleNamespace(pp_size=1))
    runner._kv_window = ModelRunner._model_window(runner)
    assert ModelRunner.kv_window.fget(runner) == expect
