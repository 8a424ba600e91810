"""Logits processors (logit_bias, min_tokens, repetition / presence / frequency penalties) on
hand-made rows: exact values, vLLM's order, batched equal to one-by-one, per-row failure isolation;
the Sampler applying them; logprobs (chosen, rank, top-k) and the engine's prompt-logprobs glue."""

import pytest
import torch

from tpengine.engine.logits_processors import (
    apply_logit_bias,
    apply_min_tokens,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    process_logits,
    token_counts,
)
from tpengine.engine.logprobs import collect_prompt_logprobs, position_logprobs
from tpengine.engine.row_sampler import RowSampler
from tpengine.engine.sampler import Sampler
from tpengine.engine.sequence import Sequence
from tpengine.engine.step import build_plan
from tpengine.sampling_params import SamplingParams

INF = float("inf")


def mk(sid: int, prompt=(1, 2, 3), out=(), **params) -> Sequence:
    s = Sequence(sid, f"r{sid}", list(prompt), SamplingParams(**params))
    for t in out:
        s.append_token(t)
    return s


def test_token_counts_exact_and_bad_id():
    c = token_counts([[0, 2, 2, 4], [], [1]], 5)
    assert c.tolist() == [[1, 0, 2, 0, 1], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert c.dtype == torch.float32
    with pytest.raises(ValueError, match=r"token id 5 is outside the vocabulary \[0, 5\)"):
        token_counts([[5]], 5)


def test_each_processor_exact():
    row = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0]])
    assert apply_logit_bias(row, [{0: 1.5, 3: -2.0}]).tolist() == [[2.5, 2.0, 3.0, 2.0, 0.0]]
    with pytest.raises(ValueError, match=r"logit_bias token id 7 is outside the vocabulary \[0, 5\)"):
        apply_logit_bias(row, [{7: 1.0}])
    assert apply_min_tokens(row, [{0, 4, 99}]).tolist() == [[-INF, 2.0, 3.0, 4.0, -INF]]  # 99 >= V: skipped
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    assert apply_repetition_penalty(x, seen, torch.tensor([2.0])).tolist() == [[1.0, -2.0, 0.5, 3.0, -4.0]]
    counts = torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0]])
    got = apply_presence_frequency_penalties(x, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    assert got.tolist() == [[2.0, -1.0, -0.5, 2.25, -2.0]]  # 0.5 - 0.5 - 2*0.25; 3 - 0.5 - 0.25
    assert row.tolist() == [[1.0, 2.0, 3.0, 4.0, 0.0]] and x[0, 0] == 2.0  # inputs untouched


def test_process_logits_order_and_sources():
    """Bias before the repetition penalty (vLLM's and HF's order): 1 + 1 = 2, then / 2 = 1.0 (the
    other order would give 1.5); repetition over prompt + output, presence / frequency over the
    output only; min_tokens masks EOS and stop_token_ids until min_tokens are generated."""
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    s = mk(0, prompt=[0], out=[1, 1], logit_bias={0: 1.0}, repetition_penalty=2.0)
    assert process_logits(x, [s]).tolist() == [[1.0, 0.5, 1.0, 1.0, 1.0, 1.0]]
    s = mk(0, prompt=[0], out=[1, 1], presence_penalty=0.5, frequency_penalty=0.25)
    assert process_logits(x, [s]).tolist() == [[1.0, 0.0, 1.0, 1.0, 1.0, 1.0]]  # the prompt's 0 untouched
    s = mk(0, out=[2], min_tokens=2, stop_token_ids=[4])
    assert process_logits(x, [s], eos_token_ids={5}).tolist() == [[1.0, 1.0, 1.0, 1.0, -INF, -INF]]
    s.append_token(2)  # 2 generated: nothing masked
    assert process_logits(x, [s], eos_token_ids={5}) is x
    s = mk(0, min_tokens=1, ignore_eos=True, stop_token_ids=[4])
    assert process_logits(x, [s], eos_token_ids={5}).tolist() == [[1.0, 1.0, 1.0, 1.0, -INF, 1.0]]
    plain = mk(1, temperature=0.0)
    assert process_logits(x, [plain], eos_token_ids={5}) is x


def test_batched_equals_one_by_one():
    g = torch.Generator().manual_seed(0)
    v = 40
    x = torch.randn(6, v, generator=g) * 3
    seqs = [mk(0, prompt=[1, 5, 5], out=[7, 7, 9], repetition_penalty=1.3),
            mk(1),
            mk(2, out=[3], min_tokens=3, stop_token_ids=[11], logit_bias={4: -5.0, 30: 2.5}),
            mk(3, prompt=[2], out=[2, 8, 8, 8], presence_penalty=1.0, frequency_penalty=-0.5),
            mk(4, out=[6, 1], repetition_penalty=0.7, frequency_penalty=2.0, logit_bias={6: 1.0}),
            mk(5, temperature=0.0, logprobs=3)]
    batched = process_logits(x, seqs, eos_token_ids={0, 39})
    for i, s in enumerate(seqs):
        assert torch.equal(batched[i], process_logits(x[i : i + 1], [s], eos_token_ids={0, 39})[0]), i
    assert torch.equal(batched[1], x[1]) and torch.equal(batched[5], x[5])
    assert batched[2, 0] == -INF and batched[2, 39] == -INF and batched[2, 11] == -INF


def test_sampler_applies_processors_and_isolates_a_failing_row():
    x = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0], [5.0, 4.0, 3.0, 0.0, 0.0], [5.0, 4.0, 3.0, 0.0, 0.0]])
    before = x.clone()
    s = Sampler(eos_token_ids={0})
    seqs = [mk(0, temperature=0.0, min_tokens=1),  # EOS 0 masked: 1
            mk(1, temperature=0.0, logit_bias={2: 3.0}),  # 3 + 3 = 6: 2
            mk(2, temperature=0.0, logit_bias={99: 1.0})]  # 99 >= V: this row's own error
    errors: dict[int, Exception] = {}
    assert s.sample(x, seqs, errors) == [1, 2, 0]
    assert list(errors) == [2] and "logit_bias token id 99 is outside the vocabulary [0, 5)" in str(errors[2])
    assert torch.equal(x, before)  # the raw logits are not modified (logprobs read them)
    with pytest.raises(ValueError, match="logit_bias token id 99"):
        s.sample(x, seqs)
    # a repetition penalty on the argmax makes the greedy pick the next one
    assert s.sample(x[:1], [mk(3, prompt=[0], temperature=0.0, repetition_penalty=1.5)]) == [1]


def test_seeded_row_same_alone_and_batched_with_penalties():
    """A seeded request draws the same tokens alone and batched with bias / penalty / min_tokens
    requests (its row is processed and drawn with its own generator only)."""
    v, steps = 30, 25
    alone_seq = mk(0, seed=77, temperature=0.9, repetition_penalty=1.2)
    batch_seq = mk(0, seed=77, temperature=0.9, repetition_penalty=1.2)
    others = [mk(1, temperature=0.0, logit_bias={3: 2.0}),
              mk(2, min_tokens=30, max_tokens=40, stop_token_ids=[4], seed=5),
              mk(3, presence_penalty=1.5, frequency_penalty=0.5), mk(4, temperature=0.7, repetition_penalty=0.8)]
    s_alone, s_batch = Sampler(seed=0, eos_token_ids={0}), Sampler(seed=9, eos_token_ids={0})
    alone = []
    for t in range(steps):
        g = torch.Generator().manual_seed(100 + t)
        row = torch.randn(1, v, generator=g) * 2
        tok = s_alone.sample(row, [alone_seq])[0]
        alone.append(tok)
        alone_seq.append_token(tok)
        x = torch.cat([torch.randn(2, v, generator=g), row, torch.randn(2, v, generator=g)])
        batch = [others[0], others[1], batch_seq, others[2], others[3]]
        toks = s_batch.sample(x, batch)
        for q, k in zip(batch, toks):
            q.append_token(k)
        assert toks[2] == tok, t
    assert len(set(alone)) > 3


def test_position_logprobs_exact():
    p = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.2, 0.3, 0.4]])
    row = torch.log(p) + 1.7  # shifted logits: the same log-softmax
    lps = position_logprobs(row, [3, 3], [3, 0])
    a, b = lps
    assert a.chosen.token_id == 3 and a.chosen.rank == 4 and a.chosen.token is None
    assert a.chosen.logprob == pytest.approx(float(torch.log(torch.tensor(0.1))), abs=1e-6)
    assert [(t.token_id, t.rank) for t in a.top] == [(0, 1), (1, 2), (2, 3)]
    assert [t.logprob for t in a.top] == pytest.approx(torch.log(p[0, :3]).tolist(), abs=1e-6)
    assert b.chosen.rank == 1 and b.top == []
    ties = position_logprobs(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), [2], [1])[0]
    assert ties.chosen.rank == 1  # 1 + tokens strictly more likely
    padded = torch.cat([row, torch.full((2, 1), 100.0)], dim=1)  # a padded column with a large logit
    got = position_logprobs(padded, [0, 1], [5, 5], vocab_size=4)
    assert [t.token_id for t in got[0].top] == [0, 1, 2, 3]  # only the real vocabulary, k capped at V
    assert got[0].chosen.logprob == pytest.approx(float(torch.log(torch.tensor(0.5))), abs=1e-6)
    with pytest.raises(ValueError, match=r"not all in the vocabulary \[0, 4\)"):
        position_logprobs(padded, [4, 0], [1, 1], vocab_size=4)
    with pytest.raises(ValueError, match="2 logits rows but 1 chosen ids and 2 top-k counts"):
        position_logprobs(row, [0], [1, 1])


def _rows(vocab: int) -> RowSampler:
    return RowSampler(Sampler(eos_token_ids={0}), vocab)  # only the glue under test: no model, no ranks


def _running(seq: Sequence, cached: int, new: int, block_size: int = 4) -> Sequence:
    seq.block_table = list(range(10 * seq.seq_id, 10 * seq.seq_id + (seq.num_tokens + block_size - 1) // block_size))
    seq.num_cached_tokens, seq.num_new_tokens = cached, new
    return seq


def test_prompt_logprobs_rows_follow_build_plan():
    """The engine reads execute()'s [B + P] rows in build_plan's prompt_idx order: a chunk (no sample),
    a full prefill, a sequence without prompt logprobs, and one whose first 3 positions were collected
    before a preemption. Row of position p gets prompt token p + 1 as its chosen token."""
    v = 16
    a = _running(mk(0, prompt=[5, 6, 7, 8, 9, 10], temperature=0.0, prompt_logprobs=2), 0, 3)  # chunk 0..2
    b = _running(mk(1, prompt=[11, 12, 13], temperature=0.0, prompt_logprobs=0, logprobs=1), 0, 3)
    c = _running(mk(2, prompt=[1, 2], temperature=0.0), 0, 2)
    d = _running(mk(3, prompt=[3, 4, 5, 6, 7], temperature=0.0, prompt_logprobs=1), 0, 5)
    d.prompt_logprobs.extend(position_logprobs(torch.zeros(3, v), [4, 5, 6], [1, 1, 1]))
    seqs = [a, b, c, d]
    plan = build_plan(seqs, True, 4, 0)
    assert plan.prompt_idx.tolist() == [0, 1, 2, 3, 4, 11]  # a: positions 0-2; b: 0-1; d: 3 (token 8 + 3)
    p = plan.prompt_idx.numel()
    g = torch.Generator().manual_seed(1)
    out = torch.randn(4 + p, v, generator=g)
    failed: dict = {}
    collect_prompt_logprobs(seqs, out[4:], v)
    toks = _rows(v).sample(out[:4], seqs, [s.samples for s in seqs], failed)
    assert failed == {}
    assert [x.chosen.token_id for x in a.prompt_logprobs] == [6, 7, 8]  # positions 0..2 of the chunk
    assert [x.chosen.token_id for x in b.prompt_logprobs] == [12, 13]
    assert [x.chosen.token_id for x in d.prompt_logprobs] == [4, 5, 6, 7]  # only position 3 added
    assert [len(x.top) for x in a.prompt_logprobs + b.prompt_logprobs] == [2, 2, 2, 0, 0]
    rows = out[4:]
    want = torch.log_softmax(rows, -1)
    assert a.prompt_logprobs[1].chosen.logprob == pytest.approx(float(want[1, 7]), abs=1e-6)
    assert d.prompt_logprobs[3].chosen.logprob == pytest.approx(float(want[5, 7]), abs=1e-6)
    assert toks[0] == 0 and toks[1:] == out[1:4].argmax(-1).tolist()  # the chunk samples nothing
    assert [x.chosen.token_id for x in b.logprobs] == [toks[1]] and b.logprobs[0].chosen.rank == 1
    assert b.cumulative_logprob == pytest.approx(float(torch.log_softmax(out[1], -1).max()), abs=1e-6)
    assert a.logprobs is None and c.logprobs is None
    with pytest.raises(RuntimeError, match="4 prompt-logprobs rows for 0 prompt positions"):
        collect_prompt_logprobs(seqs, rows[:4])  # all collected now: none is asked again
