"""The parts of a step's update on rank 0, on fakes (no model, no ranks): the rows' tokens
(RowSampler), the n > 1 forks (SampleForker), speculative proposal and verification (SpecDecoder),
and StepUpdater joining them over a real Scheduler. Token-for-token equality with the model:
tests/test_spec_decode_engine.py, test_parallel_sampling.py, test_request_isolation.py."""

from __future__ import annotations

import itertools

import torch

from tpengine.config import EngineConfig, SpeculativeConfig
from tpengine.engine.parallel_sampling import SampleForker
from tpengine.engine.row_sampler import RowSampler
from tpengine.engine.sampler import Sampler
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.engine.spec_decode import SpecDecoder, SpecState, output_rows
from tpengine.engine.step import build_plan
from tpengine.engine.structured_output import StructuredState
from tpengine.engine.update import ScheduledStep, StepUpdater
from tpengine.sampling_params import SEED_END, SamplingParams


def seq(sid: int, prompt=(1, 2, 3), **params) -> Sequence:
    return Sequence(sid, f"r{sid}", list(prompt), SamplingParams(**params))


def spec_decoder(k: int = 3) -> SpecDecoder:
    return SpecDecoder(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1), max_model_len=64,
                       block_size=4)


def test_greedy_rows_are_read_from_their_output_rows():
    rows = RowSampler(Sampler(), vocab_size=8)
    batch = [seq(0), seq(1), seq(2)]
    assert rows.take(torch.tensor([10, 11, 12, 13]), True, batch, [0, 3, 2], [0, 1, 2], [True] * 3, {}, None) \
        == [10, 13, 12]


def test_sampled_rows_draw_alone_and_a_failing_row_is_its_own():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(4, 8, generator=g)
    batch = [seq(0, temperature=0.0), seq(1, temperature=1e-40, seed=1), seq(2, temperature=0.0),
             seq(3, temperature=0.0)]
    failed: dict = {}
    tokens = RowSampler(Sampler(), vocab_size=8).take(out, False, batch, [3, 1, 0, 2], [0, 1, 2, 3],
                                                      [True, True, True, False], failed, None)
    assert list(failed) == [1] and failed[1][0] == "sampling"
    assert str(failed[1][1]) == "probability tensor contains either `inf`, `nan` or element < 0"
    assert tokens == [int(out[3].argmax()), 0, int(out[0].argmax()), 0]  # the failed row and the chunk: 0


def test_prompt_logprobs_failure_fails_the_rows_that_asked():
    a, b = seq(0, prompt_logprobs=1), seq(1)
    failed: dict = {}
    RowSampler(Sampler(), vocab_size=8).prompt_logprobs([a, b], torch.zeros(5, 8), failed)  # no prompt rows
    assert list(failed) == [0] and failed[0][0] == "prompt logprobs"


class Sched:
    """The scheduler's fork interface, recording."""

    room = staticmethod(Scheduler.room)

    def __init__(self):
        self.forks = []

    def fork(self, parent, children):
        self.forks.append((parent.seq_id, [c.seq_id for c in children]))


class Outputs:
    """The output processor's interface, recording; ``detokenize`` raises for request ``poison``."""

    def __init__(self, poison: str | None = None):
        self.poison, self.samples, self.dropped, self.finished = poison, [], [], []

    def add_sample(self, s):
        self.samples.append(s.seq_id)

    def detokenize(self, s, tok):
        if s.request_id == self.poison:
            raise IndexError(f"piece id {tok} is out of range")
        return False

    def finish_sample(self, s):
        self.finished.append(s.request_id)
        return f"final {s.request_id}"

    def stream_output(self, rid):
        return None

    def sequences(self, rid):
        return []

    def drop(self, rid):
        self.dropped.append(rid)


def test_fork_starts_the_other_samples_on_their_parents_row():
    parent = seq(0, n=3, seed=SEED_END - 2, prompt_logprobs=1)
    parent.spec = SpecState(proposed=4, accepted=2, num_draft_cached_tokens=3)
    parent.structured = StructuredState(grammar=type("G", (), {"matcher": lambda self: object()})(), matcher=None)
    single, chunk = seq(1), seq(2, n=2)
    sched, outputs, ids = Sched(), Outputs(), itertools.count(10)
    batch, rows = SampleForker(sched, outputs, lambda: next(ids)).fork([single, parent, chunk], [True, True, False])
    kids = batch[3:]
    assert [s.seq_id for s in batch] == [1, 0, 2, 10, 11] and rows == [0, 1, 2, 1, 1]
    assert sched.forks == [(0, [10, 11])] and outputs.samples == [10, 11]
    assert [k.index for k in kids] == [1, 2] and [k.params.seed for k in kids] == [SEED_END - 1, 0]  # wraps
    assert all(k.params.prompt_logprobs is None and k.prompt_logprobs is None for k in kids)
    assert all(k.spec == SpecState() and k.structured.matcher is not None for k in kids)
    assert all(k.prompt_token_ids == [1, 2, 3] and k.arrival_time == parent.arrival_time for k in kids)


def test_output_rows_put_proposed_positions_after_the_sampled_and_prompt_rows():
    a, b, c = seq(0), seq(1), seq(2)
    a.proposal, c.proposal = [7, 8], [9]
    row = output_rows([a, b, c], 5)
    assert [row(0, 0), row(0, 1), row(0, 2), row(1, 0), row(2, 0), row(2, 1)] == [5, 6, 0, 1, 7, 2]


class Reserving:
    max_num_batched_tokens = 4

    def __init__(self):
        self.reserved = []

    def reserve_proposal(self, s, proposal):
        self.reserved.append((s.seq_id, proposal))
        s.proposal = list(proposal)
        return True


def test_proposals_stay_inside_the_step_budget_and_the_policy():
    seqs = [seq(i, prompt=(1, 2, 3, 1, 2)) for i in range(3)]
    sched = Reserving()
    assert spec_decoder().schedule(seqs, sched, None, step=0)
    assert sched.reserved == [(0, [3])]  # 4 - 3 decodes: one token of budget
    off = SpecDecoder(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=2),
                      max_model_len=64)
    assert not off.schedule(seqs, Reserving(), None, step=0) and not spec_decoder().schedule([], sched, None, 0)


def test_verify_takes_positions_while_the_proposed_token_was_taken():
    spec = spec_decoder()
    a, b, c = seq(0), seq(1), seq(2)
    a.proposal, b.proposal = [5, 6, 7], [8]
    for s in (a, b, c):
        s.spec = SpecState(num_draft_cached_tokens=9)
        s.num_cached_tokens = 3
    spec.count_proposed([a, b, c])
    calls, trimmed = [], []

    def take(live, j):
        calls.append((live, j))
        return {1: [6], 2: [1]}[j]  # position 1 takes the proposed 6, position 2 rejects 7

    assert spec.verify([a, b, c], [5, 9, 4], take, trimmed.append) == 2
    assert calls == [([0], 1), ([0], 2)] and trimmed == [a, b]
    # counted, the draft's K/V kept for the accepted tokens, and each proposal in its sequence's window
    assert (a.spec, b.spec, c.spec) == (SpecState(3, 2, 3, [(3, 2)]), SpecState(1, 0, 3, [(1, 0)]), SpecState(0, 0, 9))
    assert a.proposal == b.proposal == []
    st = spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_pos) == (2, 4, 2, [1, 1, 0])


def updater(sched: Scheduler, outputs: Outputs, spec: SpecDecoder | None = None) -> StepUpdater:
    ids = itertools.count(100)
    return StepUpdater(sched, outputs, RowSampler(Sampler(), 16), SampleForker(sched, outputs, lambda: next(ids)),
                       spec)


def scheduled(sched: Scheduler, spec: SpecDecoder | None = None, step: int = 0) -> ScheduledStep:
    seqs, is_prefill = sched.schedule()
    speculative = spec is not None and not is_prefill and spec.schedule(seqs, sched, None, step)
    plan = build_plan(seqs, is_prefill or speculative, 4, step, greedy=True, block_copies=sched.take_block_copies())
    return ScheduledStep(seqs, is_prefill, speculative, plan, [s.samples for s in seqs], None, 0.0)


def test_a_speculative_greedy_step_takes_the_accepted_prefix_and_trims_the_rest():
    sched = Scheduler(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      16, eos_token_ids={15})
    spec, outputs = spec_decoder(k=3), Outputs()
    a = seq(0, prompt=(1, 2, 3, 1, 2), max_tokens=5)
    a.spec = SpecState()
    sched.add(a)
    up = updater(sched, outputs, spec)
    assert up.update(scheduled(sched, spec), torch.tensor([3])) == ([], 1)  # the prefill's token
    step = scheduled(sched, spec, step=1)
    assert step.speculative and a.proposal == [1, 2, 3] and len(a.block_table) == 3  # positions 5..8
    done, emitted = up.update(step, torch.tensor([9, 1, 5, 7]))  # row 1 takes the proposed 1, row 2 rejects 2
    assert a.completion_token_ids == [3, 1, 5] and emitted == 2 and done == []
    assert a.spec == SpecState(3, 1, 0, [(3, 1)]) and a.proposal == [] and spec.stats.accepted_per_pos == [1, 0, 0]
    assert len(a.block_table) == 2 and a.num_cached_tokens == 7  # position 8's block went back
    step = scheduled(sched, spec, step=2)
    assert not step.speculative and a.proposal == []  # 5 occurs nowhere earlier: nothing to propose
    assert up.update(step, torch.tensor([15])) == (["final r0"], 1)  # EOS
    assert a.finish_reason == "stop" and a.spec == SpecState(3, 1, 0, [(3, 1)])
    assert sched.block_manager.num_free_blocks == 16 and spec.stats.num_drafts == 1
    # the policy timed both kinds of decode step (the speculative one with its 3 proposed tokens)
    assert set(spec.policy.seconds) == {(1, True), (1, False)} and len(spec.policy.plain[1]) == 1
    assert spec.policy.extra == {} and spec.policy.since_plain[1] == 0  # no plain time before it: no cost yet


def test_a_request_whose_text_fails_ends_alone():
    sched = Scheduler(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      16, eos_token_ids={99})
    outputs = Outputs(poison="r1")
    for s in (seq(0, max_tokens=2), seq(1, max_tokens=2), seq(2, max_tokens=1)):
        sched.add(s)
    done, emitted = updater(sched, outputs).update(scheduled(sched), torch.tensor([4, 5, 6]))
    assert emitted == 3 and [getattr(o, "request_id", o) for o in done] == ["r1", "final r2"]
    assert done[0].error == "detokenizing failed: IndexError: piece id 5 is out of range"
    assert outputs.dropped == ["r1"] and [s.request_id for s in sched.running] == ["r0"]
    assert sched.running[0].completion_token_ids == [4]
