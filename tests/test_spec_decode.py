"""Speculative decoding's parts (issue 39): the config as vLLM's JSON, the n-gram proposer, the policy
that measures when it pays, the block bookkeeping of proposed positions, the plan's speculative rows,
the counters in the run summary and /metrics."""

from __future__ import annotations

import pytest
import torch

from tpengine.config import EngineConfig, SpeculativeConfig
from tpengine.engine.block_manager import BlockManager
from tpengine.engine.sequence import Sequence
from tpengine.engine.spec_decode import NgramProposer, SpecDecoder, SpecPolicy, SpecState
from tpengine.engine.step import build_plan, pack, unpack
from tpengine.engine.structured_output import StructuredState
from tpengine.sampling_params import SamplingParams


def ngram(k=4, lo=None, hi=None) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_config_parses_vllm_json_with_its_defaults():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=3,
                                                       prompt_lookup_max=3)
    assert cfg.replace(seed=2).speculative_config == cfg.speculative_config  # a config stays a config
    s = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert (s.method, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 5, 5)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    d = SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": 3})
    assert (d.method, d.model) == ("draft_model", "draft")
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize("value, message", [
    ("{", "invalid speculative_config '{': not JSON (Expecting property name enclosed in double quotes: line 1 "
          "column 2 (char 1))"),
    ("[4]", 'invalid speculative_config [4]: must be a JSON object such as {"method": "ngram", '
            '"num_speculative_tokens": 4}'),
    ({"method": "ngram"}, "invalid speculative_config: num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "invalid speculative_config num_speculative_tokens=0: must be an integer >= 1"),
    ({"num_speculative_tokens": True}, "invalid speculative_config num_speculative_tokens=True: must be an "
                                       "integer >= 1"),
    ({"num_speculative_tokens": 2, "k": 1}, "invalid speculative_config: unknown key(s) ['k']; valid: "
                                            "num_speculative_tokens, method, model, prompt_lookup_min, "
                                            "prompt_lookup_max, disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "invalid speculative_config method='eagle': must be one "
                                                       "of ngram, draft_model"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "invalid speculative_config prompt_lookup_min=4: must be <= prompt_lookup_max (2)"),
    ({"num_speculative_tokens": 2, "method": "draft_model"}, "invalid speculative_config model=None: must be the "
                                                             "draft model's folder (a string) with method draft_model"),
    ({"num_speculative_tokens": 2, "method": "ngram", "model": "x"}, "invalid speculative_config model='x': must "
                                                                     "be unset with method ngram (the proposer reads "
                                                                     "the sequence itself)"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "invalid speculative_config disable_by_batch_size=0: "
                                                                "must be an integer >= 1 or unset"),
])
def test_bad_configs_name_the_value(value, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=value)
    assert str(e.value) == message


def test_ngram_proposes_what_followed_the_longest_latest_match():
    p = ngram(4, 2, 3)
    assert p.propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]  # vLLM's docstring example: [2, 3] matches, 3 follow
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]) == [7, 8, 5, 2]  # the latest "2 3" of three
    assert p.propose([5, 1, 2, 3, 9, 0, 2, 3, 8, 1, 2, 3]) == [9, 0, 2, 3]  # "1 2 3" (n=3) beats a later "2 3"
    assert p.propose([7, 1, 1, 1]) == [1]  # overlapping: "1 1" ends at 2, one token follows
    assert p.propose([1, 2, 3, 4]) == [] and p.propose([1, 2]) == [] and p.propose([]) == []
    assert p.propose([1, 2, 3, 1, 2], k=1) == [3] and p.propose([1, 2, 3, 1, 2], k=0) == []
    assert ngram(2, 1, 1).propose([4, 5, 6, 4]) == [5, 6]  # n = 1 (k caps it)


def test_room_keeps_proposals_inside_max_tokens_and_max_model_len():
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1), max_model_len=20)
    seq = Sequence(0, "r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=10))
    assert spec.room(seq) == 4 and spec.propose(seq, 8) == [3, 1, 2] and spec.propose(seq, 2) == [3, 1]
    seq.token_ids += [3] * 7  # 7 generated: 10 - 7 - 1 = 2 more may be proposed (the step emits up to 3)
    assert spec.room(seq) == 2
    seq.params = SamplingParams(max_tokens=None)
    seq.token_ids += [3] * 5  # 17 tokens: 20 - 17 - 1
    assert spec.room(seq) == 2
    seq.params = SamplingParams(prompt_logprobs=1)
    assert spec.room(seq) == 0
    seq.params, seq.structured = SamplingParams(), StructuredState(object(), object())  # never proposed for
    assert spec.room(seq) == 0


def test_ngram_searches_the_output_too():
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4),
                       max_model_len=64)
    seq = Sequence(0, "r", [1, 2, 3, 4, 9], SamplingParams())
    seq.token_ids += [5, 3, 4, 7, 7, 6, 3, 4]  # the output
    assert spec.propose(seq, 3) == [7, 7, 6]  # "3 4" is in the prompt and the output: the output's, the latest
    seq.token_ids += [7, 7]  # "3 4 7 7" (n=4) occurs only in the output
    assert spec.propose(seq, 3) == [6, 3, 4]


def test_policy_fixed_rule():
    fixed = SpecPolicy(disable_by_batch_size=4)
    assert [fixed.threshold(b) for b in (1, 4, 5)] == [0.0, 0.0, None]
    state = SpecState()
    for _ in range(5):
        fixed.judge(state, 4, 0, 0.0)  # nothing accepted: it still proposes all it can
    assert fixed.length(state, 4, 0.0) == 4 and state.skip == 0 and state.recent == [(4, 0)] * 5


def test_policy_measures_what_a_proposed_token_costs():
    p = SpecPolicy()
    assert [p.bucket(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [1, 2, 2, 3, 3, 4, 7]
    assert p.threshold(1) == 0.0 and p.token_cost(1) is None  # nothing measured: every sequence proposes
    p.record(1, True, 0.030, 3, proposed=4)
    p.record(1, True, 0.030, 5, proposed=4)
    assert p.threshold(1) is None  # two speculative steps, no plain one: time one
    p.record(1, False, 0.020, 1)
    p.record(1, True, 0.024, 2, proposed=4)  # 4 ms beyond the 20 ms plain step: 1 ms a proposed token
    assert p.token_cost(1) == pytest.approx(0.05) and p.threshold(1) == pytest.approx(0.05)
    for _ in range(20):
        p.record(1, True, 0.026, 2, proposed=2)  # the median of the last 16: 3 ms a token
    assert p.token_cost(1) == pytest.approx(0.15) and p.since_plain[1] == 21
    for _ in range(p.REFRESH - 22):
        p.record(1, True, 0.026, 2, proposed=2)
    assert p.threshold(1) == pytest.approx(0.15)
    p.record(1, True, 0.026, 2, proposed=2)
    assert p.threshold(1) is None  # REFRESH speculative steps since the last plain one: time one again
    p.record(1, False, 0.02, 1)
    assert p.threshold(1) == pytest.approx(0.15)
    # at 8 sequences a proposed token costs 7.9 plain emitted ones: plain steps, and a speculative one
    # again once the bucket's speculative time is under 3 % of its time (every ~288 steps here)
    p.record(8, False, 0.09, 8)
    p.record(8, True, 0.8, 8, proposed=8)
    assert p.token_cost(8) == pytest.approx(0.71 / 0.09)
    picks = []
    for _ in range(2000):
        picks.append(p.threshold(8))
        if picks[-1] is None:
            p.record(8, False, 0.09, 8)
        else:
            p.record(8, True, 0.8, 8, proposed=8)
    # the k-th speculative step once the plain time P > k * 0.8 s * (1 / 0.03 - 1)
    assert [i for i, x in enumerate(picks) if x is not None] == [287, 575, 864, 1152, 1441, 1729]
    assert picks[287] == 0.0 and p.token_cost(9) == pytest.approx(0.71 / 8 * 9 / 0.09)  # 9: the same bucket
    q = SpecPolicy()
    q.record(1, True, 0.05, 0, proposed=4)  # nothing emitted: ignored
    assert q.seconds == {} and q.since_plain == {}


def test_policy_judges_a_sequence_by_its_recent_window_and_retries():
    p, k, rho = SpecPolicy(), 4, 0.1
    s = SpecState()
    assert p.length(s, k, rho) == 4  # a new sequence proposes all it can
    for accepted in (4, 1, 1):
        p.judge(s, 4, accepted, rho)
    # positions 2, 3 and 4 were each reached 3 times and accepted once: 1/3
    assert p.length(s, k, rho) == 4 and p.length(s, k, 0.4) == 1  # at rho 0.4 only the first position pays
    for _ in range(5):
        p.judge(s, 1, 0, rho)
    assert len(s.recent) == p.WINDOW and s.skip == 0  # position 1: 3 of 8 accepted, 0.375 > 0.1
    waits = []
    for _ in range(8):  # nothing accepted: the window turns bad, the sequence backs off, retries, ...
        p.judge(s, 4, 0, rho)
        waits.append(s.skip)
        steps = 0
        while p.length(s, k, rho) == 0:
            steps += 1
        assert steps == waits[-1]  # it sits out exactly its back-off, then proposes again
    assert s.recent == [(4, 0)] * 8
    assert waits == [0, 0, 4, 8, 16, 32, 64, 64]  # 2/8 and 1/8 still pay; then doubling while it fails, capped
    p.judge(s, 4, 4, rho)  # a retry that pays (1/8 > 0.1): proposing goes on, the back-off starts over
    assert s.skip == s.backoff == 0 and p.length(s, k, rho) == 4
    p.judge(s, 4, 0, 0.2)  # 1/8 at a threshold of 0.2
    assert s.skip == p.BACKOFF_START


def test_a_request_that_stops_repeating_and_repeats_again_is_found_again():
    """The issue-59 case: a request copies its prompt, then writes text nothing predicts, then copies
    again. Its proposals stop while they fail, the shadow proposals made meanwhile cost no step, and
    real ones come back as soon as the copy does: it is not switched off for the rest of the request."""
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
                       max_model_len=4096)
    prompt = list(range(100, 160))
    noise = torch.randint(1000, 1020, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    text = prompt[:40] + noise + prompt[:60]  # short n-grams of the noise recur, by chance
    seq = Sequence(0, "r", prompt + text[:1], SamplingParams(max_tokens=None))
    seq.spec = SpecState()
    proposed_at = []
    while seq.num_completion_tokens < len(text):
        g = seq.num_completion_tokens
        seq.proposal = spec.propose(seq, spec.limit(seq, 0.3))  # a proposed token costs 0.3 plain ones
        truth = text[g:g + len(seq.proposal) + 1]
        m = next((j for j, (a, b) in enumerate(zip(seq.proposal, truth)) if a != b), len(truth) - 1)
        if seq.proposal:
            spec.policy.judge(seq.spec, len(seq.proposal), m, 0.3)
            proposed_at.append(g)
        seq.token_ids += truth[:m + 1]
    copy1, noisy, copy2 = ([g for g in proposed_at if lo <= g < hi] for lo, hi in ((0, 40), (40, 190), (190, 250)))
    assert copy1 == list(range(2, 40, 5))  # from its third token on: 4 proposed, 4 accepted, 5 tokens a step
    # the noise: proposals while the window still holds the copy's, then back-offs of 4, 8, ..., 64
    # steps, each ended by one failed probe (the shadows meanwhile never reach 0.3)
    assert noisy == [69, 79, 87, 96, 97, 99, 122, 135, 152, 187]
    # the copy again: its first n-gram at 192, shadows from 192 on, three of them accepted by 198
    assert copy2[0] == 198 and len(copy2) == 11 and not seq.spec.shadows


def test_blocks_for_proposed_positions_and_their_trim():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence(0, "r", list(range(6)), SamplingParams())
    bm.allocate(seq)
    assert len(seq.block_table) == 2
    seq.num_cached_tokens = 5
    assert bm.can_append(seq, 5) and not bm.can_append(seq, 4 * 8)
    assert bm.may_append(seq, 5) == [] and len(seq.block_table) == 3  # positions 5..10
    free = bm.num_free_blocks
    seq.token_ids += [6, 7]  # two accepted: 8 tokens need 2 blocks
    assert bm.trim(seq) == 1 and len(seq.block_table) == 2 and bm.num_free_blocks == free + 1
    assert bm.trim(seq) == 0


def test_forked_partial_block_is_copied_before_proposals_write_it():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = Sequence(0, "r", list(range(6)), SamplingParams())
    bm.allocate(parent)
    child = Sequence(1, "r", list(range(6)), SamplingParams())
    bm.fork(parent, child)
    parent.token_ids.append(9)
    copies = bm.may_append(parent, 3)  # writes positions 6..9: block 1 (shared) is copied, block 2 is new
    assert copies == [(child.block_table[1], parent.block_table[1])] and len(parent.block_table) == 3
    assert parent.block_table[0] == child.block_table[0] and parent.block_table[1] != child.block_table[1]


def test_plan_carries_the_speculative_rows():
    a = Sequence(0, "a", [5, 6, 7], SamplingParams())
    b = Sequence(1, "b", [8, 9], SamplingParams())
    for s, blocks in ((a, [3, 4, 2]), (b, [1])):
        s.block_table, s.num_cached_tokens, s.num_new_tokens = blocks, s.num_tokens - 1, 1
    a.proposal, a.num_new_tokens = [1, 2], 3
    plan = build_plan([a, b], True, 2, step=7)
    assert plan.input_ids.tolist() == [7, 1, 2, 9]
    assert plan.positions.tolist() == [2, 3, 4, 1]
    assert plan.slot_mapping.tolist() == [4 * 2 + 0, 4 * 2 + 1, 2 * 2 + 0, 1 * 2 + 1]
    assert plan.sample_idx.tolist() == [2, 3] and plan.spec_idx.tolist() == [0, 1]
    assert plan.context_lens.tolist() == [5, 2]
    back = unpack(*pack(plan))
    assert back.spec_idx.tolist() == [0, 1] and back.input_ids.tolist() == plan.input_ids.tolist()
    assert torch.equal(back.block_tables, plan.block_tables)


def test_summary_and_metrics_show_the_counters():
    from tpengine.engine.stats import EngineStats
    from tpengine.frontend.progress import ProgressReporter
    from tpengine.server.metrics import ServerMetrics

    stats = EngineStats(10, 1, 9, 100, 40, 0, 5, 8, 1, 0, speculative=True, spec_num_drafts=8,
                        spec_num_draft_tokens=32, spec_num_accepted_tokens=12, spec_accepted_per_pos=(6, 3, 2, 1))
    assert stats.spec_acceptance_rate == 0.375 and stats.spec_mean_acceptance_length == 2.5
    progress = ProgressReporter(total=1, enabled=False)
    progress.on_step(stats)
    assert progress.summary()["spec_decode"] == {"num_drafts": 8, "num_draft_tokens": 32, "num_accepted_tokens": 12,
                                                 "acceptance_rate": 0.375, "mean_acceptance_length": 2.5}
    plain = ProgressReporter(total=1, enabled=False)
    plain.on_step(EngineStats(1, 1, 0, 1, 1, 0, 5, 8, 0, 0))
    assert "spec_decode" not in plain.summary()
    m = ServerMetrics("m")
    m.observe_step(stats, [])
    m.observe_step(stats, [])  # cumulative counts: no double counting
    text = m.render().decode()
    assert 'tpengine:spec_decode_num_drafts_total{model_name="m"} 8.0' in text
    assert 'tpengine:spec_decode_num_draft_tokens_total{model_name="m"} 32.0' in text
    assert 'tpengine:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0' in text
    assert 'tpengine:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 1.0' in text
    assert "spec_decode" not in ServerMetrics("m").render().decode()
