"""The StepPlan control message: pack/unpack round trip and the one payload layout."""

import torch

from tpengine.engine.sampling_params import SamplingParams
from tpengine.engine.sequence import Sequence
from tpengine.engine.step import PAYLOAD_FIELDS, StepKind, StepPlan, build_plan, pack, payload_sizes, unpack


def test_pack_unpack_round_trip_and_payload_layout():
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams())
    b = Sequence(1, "b", [7, 8], SamplingParams())
    a.block_table, b.block_table = [3, 1], [0]
    plan = build_plan([a, b], True, 4, step=5, greedy=True)
    assert plan.slot_mapping.tolist() == [12, 13, 14, 15, 4, 0, 1]
    header, payload = pack(plan)
    assert header.tolist()[2:] == [7, 2, 2, 5, 1]
    assert payload_sizes(7, 2, 2) == [7, 7, 7, 4, 3, 3, 2, 2]
    assert payload.numel() == sum(payload_sizes(7, 2, 2)) == 3 * 7 + 2 * 2 + 2 * 3 + 2 * 2
    got = unpack(header, payload)
    assert (got.kind, got.step, got.greedy) == (StepKind.PREFILL, 5, True)
    for name, _ in PAYLOAD_FIELDS:
        assert torch.equal(getattr(got, name), getattr(plan, name)), name
    assert got.block_tables.tolist() == [[3, 1], [0, -1]]
    stop = unpack(*pack(StepPlan(kind=StepKind.STOP, step=9)))
    assert (stop.kind, stop.step, stop.input_ids) == (StepKind.STOP, 9, None)
