"""Scheduler with prefix caching and chunked prefill: requests wait one step for a prefix being
computed and then share it, preemption while blocks are shared, mixed decode + chunk steps, a chunk
that leaves one token, and prompts that run whole without chunking."""

from test_scheduler import EOS, cfg, drain, seq, step

from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams


def shared(sid: int, prefix: list[int], n_own: int, **params) -> Sequence:
    return Sequence(sid, f"r{sid}", prefix + [5000 + sid * 50 + i for i in range(n_own)], SamplingParams(**params))


def test_requests_sharing_a_prefix_wait_one_step_and_share_its_blocks():
    """Four prompts with a 12-token common prefix (3 blocks of 4): the first computes it, the others
    wait one step instead of computing it again, then share its 3 blocks."""
    sched = Scheduler(cfg(max_num_seqs=8), 64, EOS)
    prefix = list(range(200, 212))
    seqs = [shared(i, prefix, 2, max_tokens=3) for i in range(4)]
    [sched.add(s) for s in seqs]
    batch, pre, _ = step(sched)
    assert pre and batch == [seqs[0]] and seqs[0].num_prefix_cached_tokens == 0
    batch, pre, _ = step(sched)
    assert pre and batch == seqs[1:]
    assert all(s.num_prefix_cached_tokens == 12 for s in seqs[1:])
    assert all(s.block_table[:3] == seqs[0].block_table[:3] for s in seqs[1:])
    assert sched.block_manager.ref_count[seqs[0].block_table[0]] == 4
    drain(sched)
    st = sched.stats()
    assert (st.prompt_tokens, st.cached_prompt_tokens) == (56, 36) and st.prefix_cache_hit_rate == 36 / 56
    assert st.num_free_blocks == 64 and st.num_cached_blocks == 3 + 4  # the prefix + each one's [own own tok tok]
    for s in seqs:
        assert s.completion_token_ids == [s.seq_id * 100 + p for p in range(14, 17)]


def test_preemption_while_blocks_are_shared_keeps_tokens_and_counts():
    """Many sequences share one prefix in a cache too small for all: preemption frees a sharer's
    reference only; the re-prefill finds its prefix (and its own full blocks) cached."""
    prefix = list(range(300, 308))  # 2 blocks
    sched = Scheduler(cfg(max_num_seqs=6, max_model_len=32), num_kv_blocks=10, eos_token_ids=EOS)
    seqs = [shared(i, prefix, 1, max_tokens=10) for i in range(6)]
    [sched.add(s) for s in seqs]
    log = []
    drain(sched, log=log)
    assert sched.num_preemptions > 0
    readmitted = [b for pre, b in log[1:] if pre for sid, n, nc in b if nc > 0]
    assert readmitted  # a preempted sequence came back with its generated tokens
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.completion_token_ids == [s.seq_id * 100 + p for p in range(9, 19)]
        assert s.num_prefix_cached_tokens == (0 if s.seq_id == 0 else 8)
    bm = sched.block_manager
    assert bm.num_free_blocks == 10 and all(r == 0 for r in bm.ref_count)


def test_chunked_prefill_keeps_running_sequences_decoding():
    """A 40-token prompt with max_num_batched_tokens 8 while two sequences decode: every step is a
    mixed step of both decodes plus a 6-token chunk (the last one 4), and the long one samples only
    after its last chunk."""
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=8), 64, EOS)
    a, b = seq(0, 3, max_tokens=20), seq(1, 3, max_tokens=20)
    [sched.add(s) for s in (a, b)]
    step(sched)  # prefill a, b
    long = seq(2, 40, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_completion_tokens == 0:
        before = (a.num_completion_tokens, b.num_completion_tokens)
        batch, pre, _ = step(sched)
        if long.num_completion_tokens == 0 and long in batch:
            chunks.append(long.num_cached_tokens)
        assert (a.num_completion_tokens, b.num_completion_tokens) == (before[0] + 1, before[1] + 1)
        assert pre == (long in batch)
    # too long for one step, so even its first chunk rides in a mixed step: 2 decodes + 6 tokens
    assert chunks == [6, 12, 18, 24, 30, 36]
    assert long.completion_token_ids == [2 * 100 + 40]
    drain(sched)
    assert long.completion_token_ids == [240, 241] and a.completion_token_ids == list(range(3, 23))
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_with_a_cached_prefix_and_chunk_ending_one_token_short():
    """A chunk that leaves exactly one prompt token makes the sequence a decode next step; a cached
    prefix counts against nothing: only the uncached tokens are chunked."""
    sched = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=8), 64, EOS)
    first = seq(0, 17, max_tokens=1)
    sched.add(first)
    drain(sched)  # computes blocks 0..3 of its 17 tokens
    again = Sequence(1, "r1", first.prompt_token_ids + [7, 7, 7, 7, 7, 7, 7, 7, 7], SamplingParams(max_tokens=2))
    sched.add(again)  # 26 tokens: 16 cached, 10 to compute: a chunk of 8, then the last 2
    batch, pre, _ = step(sched)
    assert pre and again.num_prefix_cached_tokens == 16 and again.num_cached_tokens == 24
    batch, pre, _ = step(sched)
    assert pre and again.num_completion_tokens == 1
    drain(sched)
    tail = Sequence(2, "r2", list(range(600, 609)), SamplingParams(max_tokens=1))  # 9 tokens: 8 + 1
    sched.add(tail)
    step(sched)
    assert tail.num_cached_tokens == 8 and not tail.is_prefilling and tail.num_completion_tokens == 0
    batch, pre, _ = step(sched)
    assert tail in batch and not pre and tail.completion_token_ids == [2 * 100 + 9]
    drain(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_without_chunked_prefill_a_prompt_runs_whole():
    sched = Scheduler(cfg(max_num_batched_tokens=64, enable_chunked_prefill=False), 64, EOS)
    s = seq(0, 40, max_tokens=1)
    sched.add(s)
    batch, pre, _ = step(sched)
    assert pre and batch == [s] and s.num_completion_tokens == 1


def test_caching_off_admits_identical_prompts_together():
    """Without prefix caching nothing is waited for: identical prompts are prefilled in one step."""
    sched = Scheduler(cfg(enable_prefix_caching=False), 64, EOS)
    seqs = [Sequence(i, f"r{i}", list(range(100, 112)), SamplingParams(max_tokens=2)) for i in range(3)]
    [sched.add(s) for s in seqs]
    batch, pre, _ = step(sched)
    assert pre and batch == seqs and all(s.num_prefix_cached_tokens == 0 for s in seqs)
    drain(sched)
    assert sched.stats().num_cached_blocks == 0
