"""The StepPlan control message: pack/unpack round trip and the one payload layout."""

import torch

from tpengine.engine.sequence import Sequence
from tpengine.engine.step import (
    PAYLOAD_FIELDS,
    PlanBuilder,
    StepKind,
    StepPlan,
    build_plan,
    pack,
    payload_sizes,
    unpack,
)
from tpengine.sampling_params import SamplingParams


def test_pack_unpack_round_trip_and_payload_layout():
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams())
    b = Sequence(1, "b", [7, 8], SamplingParams())
    a.block_table, b.block_table = [3, 1], [0]
    a.num_new_tokens, b.num_new_tokens = 5, 2
    plan = build_plan([a, b], True, 4, step=5, greedy=True)
    assert plan.slot_mapping.tolist() == [12, 13, 14, 15, 4, 0, 1]
    header, payload = pack(plan)
    assert header.tolist()[2:] == [7, 2, 2, 5, 1, 0, 0, 0, 0]
    assert payload_sizes(7, 2, 2) == [7, 7, 7, 4, 3, 3, 2, 2, 0, 0, 0]
    assert payload.numel() == sum(payload_sizes(7, 2, 2)) == 3 * 7 + 2 * 2 + 2 * 3 + 2 * 2
    got = unpack(header, payload)
    assert (got.kind, got.step, got.greedy) == (StepKind.PREFILL, 5, True)
    for name, _ in PAYLOAD_FIELDS:
        assert torch.equal(getattr(got, name), getattr(plan, name)), name
    assert got.block_tables.tolist() == [[3, 1], [0, -1]]
    stop = unpack(*pack(StepPlan(kind=StepKind.STOP, step=9)))
    assert (stop.kind, stop.step, stop.input_ids) == (StepKind.STOP, 9, None)


def test_prompt_logits_rows_and_block_copies_round_trip():
    """A sequence asking for prompt logprobs gets the logits of its prompt positions but the last
    (which is sampled) and not those already collected; block copies travel as [C, 2]."""
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=1))
    b = Sequence(1, "b", [7, 8, 9], SamplingParams(prompt_logprobs=0))
    a.block_table, b.block_table = [3, 1], [0]
    a.num_new_tokens = 5
    b.num_cached_tokens, b.num_new_tokens = 1, 2  # a chunk after position 0, position 1 collected
    b.prompt_logprobs.append(None)
    b.prompt_logprobs.append(None)
    plan = build_plan([a, b], True, 4, step=2, block_copies=[(3, 6), (0, 2)])
    assert plan.prompt_idx.tolist() == [0, 1, 2, 3]  # a's positions 0..3; b's position 1 is collected
    header, payload = pack(plan)
    assert header.tolist()[2:] == [7, 2, 2, 2, 0, 4, 2, 0, 0]
    assert payload.numel() == sum(payload_sizes(7, 2, 2, 4, 2)) == 3 * 7 + 2 * 2 + 2 * 3 + 2 * 2 + 4 + 4
    got = unpack(header, payload)
    assert got.block_copies.tolist() == [[3, 6], [0, 2]] and got.prompt_idx.tolist() == [0, 1, 2, 3]


def test_plan_of_a_cached_prefix_a_chunk_and_a_decode():
    """A mixed step: ``a`` decodes (one token over 5 cached), ``b`` computes positions 4..6 of its 10
    after a cached first block (a chunk: its prefix comes from the cache, its last token is not the
    prompt's)."""
    a = Sequence(0, "a", [1, 2, 3, 4, 5, 6], SamplingParams())
    b = Sequence(1, "b", list(range(10, 20)), SamplingParams())
    a.block_table, b.block_table = [3, 1], [2, 0, 4]
    a.num_cached_tokens, a.num_new_tokens = 5, 1
    b.num_cached_tokens, b.num_new_tokens = 4, 3
    plan = build_plan([a, b], True, 4, step=1)
    assert plan.input_ids.tolist() == [6, 14, 15, 16]
    assert plan.positions.tolist() == [5, 4, 5, 6]
    assert plan.slot_mapping.tolist() == [5, 0, 1, 2]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 4] and plan.cu_seqlens_k.tolist() == [0, 6, 13]
    assert plan.context_lens.tolist() == [6, 7] and plan.sample_idx.tolist() == [0, 3]
    assert a.samples and not b.samples


def test_plan_builder_reuses_its_tensors_while_the_shape_repeats():
    """The engine's PlanBuilder gives build_plan's values; a plan of the last one's field sizes is written
    into the last plan's payload (the same tensors), another shape gets new ones; pack sends the payload."""
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams())
    a.block_table, a.num_new_tokens = [3, 1], 5
    builder, plans = PlanBuilder(4), []
    for step, (cached, new, table) in enumerate([(0, 5, [3, 1]), (5, 1, [3, 1]), (6, 1, [3, 1]), (7, 1, [3, 1]),
                                                 (8, 1, [3, 1, 6])]):
        a.num_cached_tokens, a.num_new_tokens, a.block_table = cached, new, table
        if step:
            a.append_token(20 + step)
        plan = builder.build([a], step == 0, step, greedy=True)
        want = build_plan([a], step == 0, 4, step, greedy=True)
        for name, _ in PAYLOAD_FIELDS:
            assert torch.equal(getattr(plan, name), getattr(want, name)), (step, name)
        assert (plan.kind, plan.step, plan.greedy) == (want.kind, step, True)
        assert torch.equal(pack(plan)[1], pack(StepPlan(**{**vars(want), "payload": None}))[1])
        plans.append(plan)
    assert plans[2].input_ids is plans[1].input_ids and plans[3].payload is plans[1].payload  # decode steps
    assert plans[1].payload is not plans[0].payload and plans[4].payload is not plans[3].payload  # new shapes
    assert plans[4].block_tables.tolist() == [[3, 1, 6]] and plans[1].context_lens.tolist() == [8]  # (rewritten)
