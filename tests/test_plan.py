"""ShardPlan partition math: head/KV/intermediate/vocab ranges, errors, slicing, serialisation."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from tpengine.model import plan as P
from tpengine.model.plan import ShardPlan

GRID = [(4, 2), (4, 4), (4, 1), (6, 2), (6, 3), (8, 2), (9, 3), (12, 4), (16, 8), (32, 8)]


def cfg(nh: int, nkv: int | None, hidden: int | None = None, inter: int = 100, vocab: int = 1001, **kw):
    return SimpleNamespace(
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        hidden_size=hidden or nh * 16,
        intermediate_size=inter,
        vocab_size=vocab,
        **kw,
    )


def assert_contiguous_even(ranges: list[tuple[int, int]], total: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    for (a0, a1), (b0, _) in itertools.pairwise(ranges):
        assert a1 == b0
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


@pytest.mark.parametrize("nh,nkv", GRID)
def test_plan_grid_invariants(nh: int, nkv: int) -> None:
    group = nh // nkv
    for tp in range(1, nh + 1):
        plan = ShardPlan.build(cfg(nh, nkv, inter=37 * nh + 5), tp)
        assert plan.tp_size == tp and len(plan.ranks) == tp
        owners = [0] * nh
        for rp in plan.ranks:
            for h in range(*rp.q_heads):
                owners[h] += 1
        assert owners == [1] * nh, f"tp={tp}: every query head on exactly one rank"
        assert_contiguous_even([rp.q_heads for rp in plan.ranks], nh)
        assert all(rp.num_q_heads >= 1 for rp in plan.ranks)
        assert_contiguous_even([rp.intermediate for rp in plan.ranks], 37 * nh + 5)
        for rp in plan.ranks:
            used = {h // group for h in range(*rp.q_heads)}
            assert set(range(*rp.kv_heads)) == used, f"tp={tp} rank={rp.rank}"
            assert rp.q_to_kv == tuple(h // group - rp.kv_heads[0] for h in range(*rp.q_heads))
            assert all(0 <= k < rp.num_kv_heads for k in rp.q_to_kv)
        assert plan.padded_vocab_size % tp == 0
        assert 1001 <= plan.padded_vocab_size < 1001 + tp
        vocab_ranges = [rp.vocab for rp in plan.ranks]
        assert_contiguous_even(vocab_ranges, plan.padded_vocab_size)
        assert len({e - s for s, e in vocab_ranges}) == 1
        if nh % tp == 0 and nkv % tp == 0:  # Megatron layout
            for r, rp in enumerate(plan.ranks):
                assert rp.q_heads == (r * nh // tp, (r + 1) * nh // tp)
                assert rp.kv_heads == (r * nkv // tp, (r + 1) * nkv // tp)
        if nh % tp == 0 and nkv < tp and tp % nkv == 0:  # replicated KV: one head per rank
            for r, rp in enumerate(plan.ranks):
                assert rp.kv_heads == (r * nkv // tp, r * nkv // tp + 1)


def test_smollm2_shape_tp2() -> None:
    plan = ShardPlan.build(cfg(9, 3, hidden=576, inter=1536, vocab=49152), 2)
    assert [rp.q_heads for rp in plan.ranks] == [(0, 5), (5, 9)]
    assert [rp.kv_heads for rp in plan.ranks] == [(0, 2), (1, 3)]
    assert [rp.q_to_kv for rp in plan.ranks] == [(0, 0, 0, 1, 1), (0, 1, 1, 1)]
    assert [rp.intermediate for rp in plan.ranks] == [(0, 768), (768, 1536)]
    assert plan.head_dim == 64 and plan.padded_vocab_size == 49152


def test_straddling_kv_head_is_held_by_both_ranks() -> None:
    # 6 heads, 2 KV heads (group 3), tp=3: rank 1 has q heads 2,3 -> KV heads 0 and 1.
    plan = ShardPlan.build(cfg(6, 2), 3)
    assert [rp.kv_heads for rp in plan.ranks] == [(0, 1), (0, 2), (1, 2)]
    assert plan.ranks[1].q_to_kv == (0, 1)


def test_missing_kv_heads_means_mha() -> None:
    plan = ShardPlan.build(cfg(4, None), 2)
    assert plan.num_kv_heads == 4 and [rp.kv_heads for rp in plan.ranks] == [(0, 2), (2, 4)]


@pytest.mark.parametrize(
    "nh,nkv,tp,needles",
    [
        (9, 3, 0, ["tp_size=0", "num_attention_heads=9", "between 1 and 9"]),
        (9, 3, 10, ["tp_size=10", "num_attention_heads=9", "between 1 and 9"]),
        (9, 3, -1, ["tp_size=-1"]),
        (9, 2, 1, ["num_attention_heads=9", "num_key_value_heads=2"]),
    ],
)
def test_invalid_plans_name_the_values(nh: int, nkv: int, tp: int, needles: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        ShardPlan.build(cfg(nh, nkv), tp)
    for needle in needles:
        assert needle in str(e.value)


def test_valid_tp_sizes() -> None:
    assert ShardPlan.valid_tp_sizes(cfg(9, 3)) == list(range(1, 10))


def test_explicit_head_dim_is_used_in_slicing() -> None:
    from transformers import Qwen3Config

    c = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=100, vocab_size=1001, num_hidden_layers=1)
    plan = ShardPlan.build(c, 2)
    assert plan.head_dim == 32  # not 64 // 4
    q = torch.randn(4 * 32, 64)
    k = torch.randn(2 * 32, 64)
    o = torch.randn(64, 4 * 32)
    assert plan.slice_spec(P.Q, False, 1) == (0, 64, 128)
    assert torch.equal(plan.shard(P.Q, False, q, 1), q[64:128])
    assert torch.equal(plan.shard(P.K, False, k, 1), k[32:64])
    assert torch.equal(plan.shard(P.ROW_HEADS, False, o, 0), o[:, :64])
    with pytest.raises(ValueError, match="expected size 128 along dim 0"):
        plan.shard(P.Q, False, torch.randn(64, 64), 0)  # the hidden // heads guess


def test_vocab_padding_c01() -> None:
    plan2 = ShardPlan.build(cfg(4, 2, vocab=1001), 2)
    assert plan2.padded_vocab_size == 1002
    assert [rp.vocab for rp in plan2.ranks] == [(0, 501), (501, 1002)]
    plan4 = ShardPlan.build(cfg(4, 2, vocab=1001), 4)
    assert plan4.padded_vocab_size == 1004
    assert [rp.vocab for rp in plan4.ranks] == [(0, 251), (251, 502), (502, 753), (753, 1004)]
    emb = torch.randn(1001, 8) + 3.0  # no zero rows
    last = plan4.shard(P.VOCAB, False, emb, 3)
    assert last.shape == (251, 8)
    assert torch.equal(last[:248], emb[753:])
    assert torch.equal(last[248:], torch.zeros(3, 8))
    assert torch.equal(torch.cat([plan4.shard(P.VOCAB, False, emb, r) for r in range(4)])[:1001], emb)


def test_row_bias_and_replicated_are_whole() -> None:
    plan = ShardPlan.build(cfg(4, 2), 2)
    assert plan.slice_spec(P.ROW, True, 1) is None and plan.slice_spec(P.ROW_HEADS, True, 0) is None
    assert plan.slice_spec(P.Q, True, 1) == (0, 32, 64)  # column biases are split
    b = torch.randn(64)
    assert torch.equal(plan.shard(P.ROW, True, b, 1), b)
    with pytest.raises(ValueError, match="rank=2"):
        plan.slice_spec(P.Q, False, 2)
    with pytest.raises(ValueError, match="'bogus'"):
        plan.slice_spec("bogus", False, 0)


@pytest.mark.parametrize("tp", [1, 3, 4])
def test_round_trip_json(tp: int) -> None:
    plan = ShardPlan.build(cfg(12, 4, vocab=1001), tp)
    again = ShardPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.ranks[0].q_heads == plan.ranks[0].q_heads and isinstance(again.ranks[0].q_heads, tuple)
