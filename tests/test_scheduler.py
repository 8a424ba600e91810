"""Scheduler: batch limits, decode after prefill, recompute preemption (C13), no block leak
over 200 mixed requests (C14), several EOS ids / ignore_eos (C12), length caps."""

import random
from collections import Counter

import pytest

from tpengine.config import EngineConfig
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.sampling_params import SamplingParams

EOS = {100_000, 100_001, 100_002}


def cfg(**kw) -> EngineConfig:
    base = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    base.update(kw)
    return EngineConfig(**base)


def seq(sid: int, n: int, **params) -> Sequence:
    return Sequence(sid, f"r{sid}", [1000 + sid * 50 + i for i in range(n)], SamplingParams(**params))


def fake(s: Sequence) -> int:
    """Deterministic 'model': the token at position p of seq s is s.seq_id * 100 + p."""
    return s.seq_id * 100 + s.num_tokens


def step(sched: Scheduler, token_fn=fake, log=None, stop_fn=None):
    """One engine step with invariant checks; returns (batch, is_prefill, finished).
    ``stop_fn(seq)``: whether the new token makes the seq's text match a stop string (as the
    engine's detokenizer reports it; default never)."""
    bm = sched.block_manager
    batch, is_prefill = sched.schedule()
    assert len(batch) <= sched.max_num_seqs and len({s.seq_id for s in batch}) == len(batch)
    if is_prefill:  # a prefill, or decodes plus prefill chunks (mixed)
        assert sum(s.num_new_tokens for s in batch) <= sched.max_num_batched_tokens
        assert all(1 <= s.num_new_tokens <= s.num_tokens - s.num_cached_tokens for s in batch)
    else:
        assert all(s.num_cached_tokens == s.num_tokens - 1 and s.num_new_tokens == 1 for s in batch)
    for s in batch:
        assert s.status is SequenceStatus.RUNNING
        assert len(s.block_table) == (s.num_tokens + bm.block_size - 1) // bm.block_size
    held = Counter(b for s in sched.running for b in s.block_table)
    assert all(bm.ref_count[b] == n for b, n in held.items())  # each holder counted once
    assert len(held) + bm.num_free_blocks == bm.num_blocks  # nothing leaked
    assert all(not s.block_table for s in sched.waiting)
    if log is not None:
        log.append((is_prefill, [(s.seq_id, s.num_tokens, s.num_completion_tokens) for s in batch]))
    stopped = [bool(stop_fn and stop_fn(s)) for s in batch]
    finished = sched.postprocess(batch, [token_fn(s) for s in batch], stopped)
    return batch, is_prefill, finished


def drain(sched, token_fn=fake, log=None, max_steps=5000):
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return
        step(sched, token_fn, log)
    raise AssertionError("scheduler did not drain")


def test_prefill_bounded_by_max_num_seqs_then_decode():
    sched = Scheduler(cfg(max_num_seqs=3), num_kv_blocks=64, eos_token_ids=EOS)
    seqs = [seq(i, 4, max_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch, pre, _ = step(sched)
    assert pre and [s.seq_id for s in batch] == [0, 1, 2]
    assert all(s.num_cached_tokens == 4 and s.num_tokens == 5 for s in batch)
    batch, pre, fin = step(sched)  # running is full: decode, not more prefill
    assert not pre and [s.seq_id for s in batch] == [0, 1, 2]
    assert [s.seq_id for s in fin] == [0, 1, 2] and all(s.finish_reason == "length" for s in fin)
    assert [s.completion_token_ids for s in fin][0] == [4, 5]
    batch, pre, _ = step(sched)
    assert pre and [s.seq_id for s in batch] == [3, 4]
    drain(sched)
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished


def test_prefill_bounded_by_max_num_batched_tokens():
    sched = Scheduler(cfg(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=16,
                          enable_chunked_prefill=False), 64, EOS)
    for i, n in enumerate([6, 6, 6, 3, 15]):
        sched.add(seq(i, n, max_tokens=3))
    sizes = []
    for _ in range(3):
        batch, pre, fin = step(sched)
        assert pre
        sizes.append([s.num_tokens - 1 for s in batch])
    assert sizes == [[6, 6], [6, 3], [15]]  # 12 (+6 > 16), 9 (+15 > 16), 15
    assert [(s.seq_id, s.finish_reason) for s in fin] == [(4, "length")]  # 16 == max_model_len
    batch, pre, _ = step(sched)
    assert not pre and [s.seq_id for s in batch] == [0, 1, 2, 3]
    drain(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_preemption_recompute_keeps_every_token_c13():
    sched = Scheduler(cfg(max_num_seqs=4), num_kv_blocks=8, eos_token_ids=EOS)
    seqs = [seq(i, 6, max_tokens=12, temperature=0) for i in range(4)]
    for s in seqs:
        sched.add(s)
    log = []
    drain(sched, log=log)
    assert sched.num_preemptions > 0
    # a preempted sequence was re-prefilled with its generated tokens included
    assert any(pre and any(nc > 0 for _, _, nc in b) for pre, b in log)
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.completion_token_ids == [s.seq_id * 100 + p for p in range(6, 18)]
        assert s.num_cached_tokens == 0 and s.block_table == []
    assert sched.block_manager.num_free_blocks == 8
    assert sched.stats().num_free_blocks == 8 and sched.stats().num_preemptions > 0


def test_preempts_most_recent_to_front_of_waiting():
    sched = Scheduler(cfg(max_num_seqs=4), num_kv_blocks=5, eos_token_ids=EOS)
    a, b, c, e, d = seq(0, 4), seq(1, 4), seq(2, 4), seq(3, 4), seq(4, 8)
    [sched.add(s) for s in (a, b, c, e, d)]
    assert step(sched)[:2] == ([a, b, c, e], True)
    # a takes the last free block; b needs one: e (newest) goes, then c preempts itself
    assert step(sched)[:2] == ([a, b], False)
    assert list(sched.waiting) == [c, e, d] and list(sched.running) == [a, b]
    assert sched.num_preemptions == 2 and c.num_cached_tokens == 0 and c.block_table == []
    assert c.completion_token_ids == [2 * 100 + 4]  # its generated token is kept
    assert sched.stats().num_waiting == 3 and sched.stats().num_free_blocks == 1


@pytest.mark.parametrize("budget", [64, 6])  # 6: most prompts prefilled in chunks, in mixed steps
@pytest.mark.parametrize("num_blocks", [64, 12])
def test_200_mixed_requests_no_block_leak_c14(num_blocks, budget):
    rng = random.Random(num_blocks)
    sched = Scheduler(cfg(max_num_seqs=8, max_model_len=32, max_num_batched_tokens=budget), num_kv_blocks=num_blocks,
                      eos_token_ids=EOS)
    plan = {}  # seq_id -> (kind, k)
    eos_at = {}
    seqs, rejected = [], 0

    def token_fn(s):
        if s.seq_id in eos_at and s.num_completion_tokens + 1 == eos_at[s.seq_id]:
            return sorted(EOS)[s.seq_id % 3]
        return fake(s)

    sid = 0
    while sid < 200 or sched.has_unfinished:
        if sid < 200:
            for _ in range(8):  # one wave
                kind = ("long", "eos", "ext", "abort", "plain", "plain")[sid % 6]
                n = 40 if kind == "long" else rng.randint(1, 13)
                s = seq(sid, n, max_tokens=rng.randint(1, 9))
                k = rng.randint(1, 9)
                plan[sid] = (kind, k)
                if kind == "eos":
                    eos_at[sid] = k
                try:
                    sched.add(s)
                    seqs.append(s)
                except ValueError as e:
                    assert kind == "long" and "40" in str(e) and "32" in str(e)
                    rejected += 1
                if kind == "abort" and k % 2:
                    sched.finish(s, "abort")  # aborted while still waiting
                sid += 1
        def stop_fn(s):  # a "stop string" found by the detokenizer in the k-th token
            kind, k = plan[s.seq_id]
            return kind == "ext" and s.num_completion_tokens + 1 == k

        for _ in range(3):
            if not sched.has_unfinished:
                break
            batch, _, _ = step(sched, token_fn, stop_fn=stop_fn)
            for s in batch:
                kind, k = plan[s.seq_id]
                if kind == "abort" and s.num_completion_tokens == 1:
                    sched.finish(s, "abort")
    assert rejected == 34 and len(seqs) == 166
    for s in seqs:
        kind, k = plan[s.seq_id]
        m = s.params.max_tokens
        assert s.is_finished and s.block_table == []
        expect = [s.seq_id * 100 + s.num_prompt_tokens + i for i in range(s.num_completion_tokens)]
        if kind == "eos" and k <= m:
            assert (s.finish_reason, s.num_completion_tokens) == ("stop", k)
            assert s.completion_token_ids[-1] in EOS
            expect[-1] = s.completion_token_ids[-1]
        elif kind == "ext" and k <= m:
            assert (s.finish_reason, s.num_completion_tokens) == ("stop", k)
        elif kind == "abort":
            assert s.finish_reason == "abort" and s.num_completion_tokens == (0 if k % 2 else 1)
        else:
            assert (s.finish_reason, s.num_completion_tokens) == ("length", m)
        assert s.completion_token_ids == expect
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.stats().num_waiting == sched.stats().num_running == 0
    if num_blocks == 12:
        assert sched.num_preemptions > 0
    st = sched.stats()
    assert st.num_cached_blocks > 0 and st.num_free_blocks == num_blocks  # cached ones are free


def test_several_eos_ids_and_ignore_eos_c12():
    sched = Scheduler(cfg(), 64, eos_token_ids={7, 9, 11})
    a = seq(0, 3, max_tokens=10)
    b = seq(1, 3, max_tokens=10)
    c = seq(2, 3, max_tokens=5, ignore_eos=True)
    d = seq(3, 3, max_tokens=10, ignore_eos=True, stop_token_ids=(42,))
    [sched.add(s) for s in (a, b, c, d)]
    script = {0: [5, 9, 1], 1: [11], 2: [7, 9, 11, 7, 9], 3: [7, 42]}
    drain(sched, token_fn=lambda s: script[s.seq_id][s.num_completion_tokens])
    assert (a.finish_reason, a.completion_token_ids) == ("stop", [5, 9])
    assert (b.finish_reason, b.completion_token_ids) == ("stop", [11])
    assert (c.finish_reason, c.completion_token_ids) == ("length", [7, 9, 11, 7, 9])
    assert (d.finish_reason, d.completion_token_ids) == ("stop", [7, 42])
    assert sched.block_manager.num_free_blocks == 64


def test_max_model_len_and_cache_caps_give_length():
    sched = Scheduler(cfg(max_model_len=10), 64, EOS)
    s = seq(0, 7, max_tokens=100)
    sched.add(s)
    drain(sched)
    assert s.finish_reason == "length" and s.num_tokens == 10 and s.num_completion_tokens == 3
    with pytest.raises(ValueError, match="10 tokens.*max_model_len is 10"):
        sched.add(seq(1, 10))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(seq(2, 0))
    small = Scheduler(cfg(max_model_len=32), num_kv_blocks=2, eos_token_ids=EOS)
    with pytest.raises(ValueError, match="9 tokens and needs 3 KV blocks.*only 2 blocks"):
        small.add(seq(3, 9))
    t, u = seq(4, 8, max_tokens=50), seq(5, 5, max_tokens=50)
    [small.add(s) for s in (t, u)]
    drain(small)  # a lone sequence stops when it no longer fits the whole cache
    assert (t.finish_reason, t.num_completion_tokens) == ("length", 1)
    assert (u.finish_reason, u.num_tokens) == ("length", 9)
    assert small.block_manager.num_free_blocks == 2 and not small.has_unfinished


def test_finish_from_outside_and_postprocess_validation():
    sched = Scheduler(cfg(), 16, EOS)
    a, b = seq(0, 5, max_tokens=4), seq(1, 5, max_tokens=4)
    [sched.add(s) for s in (a, b)]
    step(sched)
    sched.finish(a, "abort")
    assert a.is_finished and a.block_table == [] and a not in sched.running
    assert sched.block_manager.num_free_blocks == 16 - 2
    assert sched.postprocess([a], [1], [False]) == [] and a.num_completion_tokens == 1  # skipped
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish(b, "oops")
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.postprocess([b], [], [])
    with pytest.raises(ValueError, match="1 sequences but 1 sampled tokens and 0 stop-string results"):
        sched.postprocess([b], [5], [])
    drain(sched)
    assert b.first_token_time is not None and b.finish_time >= b.first_token_time
    assert sched.block_manager.num_free_blocks == 16


def test_finish_reasons_in_postprocess():
    """A stop id wins over a stop string (the id stays in token_ids); a stop string on the token
    that also reaches max_tokens gives "stop"; otherwise "length"."""
    sched = Scheduler(cfg(), 16, eos_token_ids={7})
    a, b, c = seq(0, 3, max_tokens=1), seq(1, 3, max_tokens=1), seq(2, 3, max_tokens=1, stop_token_ids=(9,))
    [sched.add(s) for s in (a, b, c)]
    batch, _ = sched.schedule()
    assert sched.is_stop_token(a, 7) and sched.is_stop_token(c, 9) and not sched.is_stop_token(b, 9)
    assert sched.postprocess(batch, [5, 5, 9], [True, False, True]) == [a, b, c]
    assert [(s.finish_reason, s.completion_token_ids) for s in (a, b, c)] == [
        ("stop", [5]), ("length", [5]), ("stop", [9])]
    assert not sched.has_unfinished and sched.block_manager.num_free_blocks == 16

