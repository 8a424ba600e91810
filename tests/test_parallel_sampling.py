"""``n > 1`` samples of one prompt (vLLM's parallel sampling): the prompt is computed once and its
KV blocks are shared (a shared partial block is copied on its first write), sample k of a request
seeded s is exactly the single request seeded s + k, and the samples survive preemption, batching
and aborts. The tp 1/2/3 equality of seeded samples is in tests/test_engine.py."""

from __future__ import annotations

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model

from tpengine.config import EngineConfig
from tpengine.engine.block_manager import BlockManager
from tpengine.engine.llm_engine import LLMEngine
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and a partial one
SAMPLED = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    return make_tiny_model(tmp_path_factory.mktemp("parallel"), vocab_size=49152, max_position_embeddings=256)


@pytest.fixture(scope="module")
def eng(model):
    return LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64, block_size=4,
                                  max_num_seqs=8))


def run(e: LLMEngine, requests) -> dict:
    return {o.request_id: o for o in e.generate([(rid, ids, SamplingParams(**p)) for rid, ids, p in requests])}


def test_sample_k_is_the_request_seeded_s_plus_k_and_the_prompt_is_computed_once(eng):
    before = eng.stats()
    out = run(eng, [("a", PROMPT, {**SAMPLED, "n": 4, "seed": 2**64 - 2})])["a"]
    after = eng.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # really sampled
    # 10 prompt tokens once, then 11 decode steps of 4 samples
    assert after.computed_tokens - before.computed_tokens == 10 + 4 * 11
    assert after.prompt_tokens - before.prompt_tokens == 10
    assert after.num_free_blocks == after.num_total_blocks  # every shared and copied block freed
    seeds = [2**64 - 2, 2**64 - 1, 0, 1]  # seed + k, wrapping at 2**64
    singles = run(eng, [(f"s{k}", PROMPT, {**SAMPLED, "seed": s}) for k, s in enumerate(seeds)])
    assert [c.token_ids for c in out.outputs] == [singles[f"s{k}"].token_ids for k in range(4)]
    assert [c.text for c in out.outputs] == [singles[f"s{k}"].text for k in range(4)]
    assert out.num_output_tokens == 48 and out.token_ids == out.outputs[0].token_ids


def test_seeded_samples_are_the_same_batched_and_under_preemption(model, eng):
    alone = run(eng, [("a", PROMPT, {**SAMPLED, "n": 3, "seed": 5})])["a"]
    others = [(f"o{i}", list(range(200 + i, 209 + i)), {**SAMPLED, "seed": i}) for i in range(3)]
    batched = run(eng, [others[0], ("a", PROMPT, {**SAMPLED, "n": 3, "seed": 5}), *others[1:]])["a"]
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in alone.outputs]
    # 12 blocks of 4 tokens: 3 samples of 22 tokens need 18, so samples are preempted and recomputed
    small = LLMEngine(EngineConfig(model=str(model), max_model_len=64, num_kv_blocks=12, block_size=4))
    tight = run(small, [("a", PROMPT, {**SAMPLED, "n": 3, "seed": 5})])["a"]
    s = small.stats()
    assert s.num_preemptions > 0 and s.num_free_blocks == s.num_total_blocks
    assert [c.token_ids for c in tight.outputs] == [c.token_ids for c in alone.outputs]


def test_greedy_samples_are_equal_and_n_beyond_max_num_seqs_is_refused(eng):
    out = run(eng, [("g", PROMPT, {"temperature": 0.0, "max_tokens": 6, "n": 3})])["g"]
    assert len(out.outputs) == 3 and out.outputs[1].token_ids == out.outputs[0].token_ids == out.outputs[2].token_ids
    bad = run(eng, [("big", PROMPT, {**SAMPLED, "n": 9})])["big"]
    assert bad.error == "request 'big': n=9 samples run as 9 sequences at once, but max_num_seqs is 8"
    assert bad.error_field == "n"


def test_aborting_a_request_ends_every_sample(eng):
    eng.add_request("a", PROMPT, SamplingParams(**{**SAMPLED, "n": 4, "seed": 1, "max_tokens": 50}))
    eng.step()  # prefill and fork
    eng.step()
    assert eng.abort_request("a")
    (out,) = eng.step()
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert [len(c.token_ids) for c in out.outputs] == [2] * 4
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0


def test_fork_shares_blocks_and_a_shared_partial_block_is_copied_on_write():
    bm = BlockManager(8, 4)
    parent = Sequence(0, "r", list(range(6)), SamplingParams(n=2))
    bm.allocate(parent)
    child = Sequence(1, "r", list(range(6)), SamplingParams(n=2))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and [bm.ref_count[b] for b in parent.block_table] == [2, 2]
    for s in (parent, child):
        s.append_token(9)  # position 6 goes to the shared partial block 1
    assert bm.can_append(child)
    assert bm.may_append(child) == [(parent.block_table[1], child.block_table[1])]  # (source, destination)
    assert child.block_table[0] == parent.block_table[0] != child.block_table[1]
    assert bm.may_append(parent) == []  # no longer shared: written in place
    assert [bm.ref_count[b] for b in parent.block_table + child.block_table[1:]] == [2, 1, 1]
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8
