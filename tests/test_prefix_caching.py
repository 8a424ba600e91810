"""Prefix caching and chunked prefill on real ranks (tp 1 and 2), float32, greedy: every output equals
the same job with both off, token for token; cached-token counts are exact; after each job every
block is free (cached blocks are free and evictable): no leak."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOLLM2_DIR, make_tiny_model
from launch import NO_MEASURING, run_engine_jobs
from test_engine import CHAT, by_id

GREEDY = {"temperature": 0.0, "ignore_eos": True}
OFF = {"enable_prefix_caching": False, "enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
LONG = 6000  # the long prompt: prefilled in chunks of 512 at tp 2


def rand(n: int, seed: int, vocab: int = 1001) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-models")
    return {"llama": make_tiny_model(root, "llama", seed=4, name="llama"),
            "long": make_tiny_model(root, "llama", seed=5, name="long", max_position_embeddings=8192)}


def base(model_dir, **kw) -> dict:
    return {"model": str(model_dir), "block_size": 4, "max_model_len": 256, "num_kv_blocks": 256, **kw}


P = rand(30, 1)  # the shared text of the "shapes" job
SHAPES = {  # request id -> prompt; expected cached prompt tokens after P alone ran first (block size 4)
    "mid": (P[:10] + rand(5, 2), 8),  # the shared prefix ends mid-block: 2 whole blocks
    "mid2": (P[:10] + rand(3, 3), 8),
    "full": (P[:16], 12),  # a full hit is capped at 15 tokens: 3 whole blocks, the 4th recomputed
    "lastdiff": (P[:15] + [P[15] % 1000 + 1], 12),  # diverges in its last prompt token
    "none": (rand(9, 4), 0),
}


def jobs(models, chat_prompts, tp: int) -> list[dict]:
    d = models["llama"]
    out = []

    def pair(key, config, **job):
        out.append({"key": f"{key}/on", "config": config, **job})
        out.append({"key": f"{key}/off", "config": {**config, **OFF}, **job})

    first = [["P", P, {**GREEDY, "max_tokens": 12}]]
    rest = [[k, p, {**GREEDY, "max_tokens": 12}] for k, (p, _) in SHAPES.items()]
    pair("shapes", base(d), waves=[first, rest])
    # eviction: wave 2's prompts need more blocks than the cache has free besides wave 1's cached ones
    qa = rand(12, 5)
    wave_a = [[f"a{i}", qa + rand(3, 10 + i), {**GREEDY, "max_tokens": 6}] for i in range(4)]
    wave_b = [[f"b{i}", rand(30, 20 + i), {**GREEDY, "max_tokens": 6}] for i in range(4)]
    again = [[f"again{i}", qa + rand(3, 10 + i), {**GREEDY, "max_tokens": 6}] for i in range(2)]
    pair("evict", base(d, num_kv_blocks=24, max_model_len=64, max_num_seqs=2), waves=[wave_a, wave_b, again])
    # preemption while 8 sequences share one 16-token prefix in a 20-block cache
    shared = rand(16, 6)
    reqs = [[f"s{i}", shared + rand(2, 30 + i), {**GREEDY, "max_tokens": 30}] for i in range(8)]
    pair("preempt", base(d, num_kv_blocks=20, max_model_len=64, max_num_seqs=8), requests=reqs)
    # chunked prefill: chunks of at most 16 tokens, decodes running between them
    reqs = [[f"c{i}", rand(n, 40 + i), {**GREEDY, "max_tokens": 10}] for i, n in enumerate((37, 5, 60, 3, 17))]
    pair("chunked", base(d, max_num_batched_tokens=16, enable_prefix_caching=False), requests=reqs)
    reqs = reqs + [["c0again", reqs[0][1], reqs[0][2]]]
    pair("chunked-cached", base(d, max_num_batched_tokens=16), requests=reqs)
    # seeded sampling: a chunk draws nothing, so chunking, caching and preemption leave the tokens alone
    seeded = [[f"r{i}", shared + rand(3 + i, 50 + i), {"temperature": 1.0, "seed": 100 + i, "max_tokens": 12,
                                                        "ignore_eos": True}] for i in range(5)]
    seeded.append(["r0twin", seeded[0][1], seeded[0][2]])
    pair("seeded", base(d, max_num_batched_tokens=16, num_kv_blocks=24, max_model_len=64, max_num_seqs=6),
         requests=seeded)
    if tp == 1:  # bfloat16: the half-precision paths (C decode kernel for a mixed step's decodes)
        out.append({"key": "chunked-bf16", "config": base(d, max_num_batched_tokens=16, dtype="bfloat16"),
                    "requests": reqs})
    # SmolLM2 chat prompts: the chat template's system prompt is a prefix they all share
    reqs = [[f"q{i}", p, {"temperature": 0.0, "max_tokens": 32}] for i, p in enumerate(chat_prompts)]
    # the measured linear layouts: greedy float32 tokens do not depend on them (test_engine, each layout)
    pair("smollm2", {"model": str(SMOLLM2_DIR), "max_model_len": 512, "kv_cache_gb": 0.2}, requests=reqs)
    if tp == 2:  # a 6000-token prompt in chunks of 512, and whole
        long = [["short", rand(20, 8), {**GREEDY, "max_tokens": 40}],  # decodes between the chunks
                ["long", rand(LONG, 7), {**GREEDY, "max_tokens": 8}]]
        cfg = base(models["long"], block_size=16, max_model_len=LONG + 64, num_kv_blocks=800)
        out.append({"key": "long/chunked", "config": {**cfg, "max_num_batched_tokens": 512}, "requests": long})
        out.append({"key": "long/whole", "config": {**cfg, **OFF, "max_num_batched_tokens": LONG + 64},
                    "requests": long})
    return out


@pytest.fixture(scope="module")
def chat_prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"]) for q in CHAT]


@pytest.fixture(scope="module")
def results(models, chat_prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix-runs")
    # every load the same default layouts (launch.NO_MEASURING): each pair compares two loads' tokens
    return {tp: run_engine_jobs(tmp, tp, jobs(models, chat_prompts, tp), tag="-prefix", env=NO_MEASURING)
            for tp in (1, 2)}


CASES = ("shapes", "evict", "preempt", "chunked", "chunked-cached", "seeded", "smollm2")


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("case", CASES)
def test_caching_and_chunking_do_not_change_tokens(results, tp, case):
    on, off = by_id(results[tp][f"{case}/on"]), by_id(results[tp][f"{case}/off"])
    assert set(on) == set(off) and len(on) >= 5
    for rid in on:
        assert on[rid]["error"] is None
        assert on[rid]["token_ids"] == off[rid]["token_ids"], rid
        assert off[rid]["num_cached_tokens"] == 0


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("case", CASES)
def test_no_block_leaks_after_a_job(results, tp, case):
    for variant in ("on", "off"):
        st = results[tp][f"{case}/{variant}"]["stats"]
        assert st["num_free_blocks"] == st["num_total_blocks"] and st["num_running"] == st["num_waiting"] == 0
        if variant == "off":
            assert st["num_cached_blocks"] == 0 and st["cached_prompt_tokens"] == 0


@pytest.mark.parametrize("tp", (1, 2))
def test_cached_token_counts_are_exact(results, tp):
    r = results[tp]
    shapes = by_id(r["shapes/on"])
    assert shapes["P"]["num_cached_tokens"] == 0
    for rid, (prompt, cached) in SHAPES.items():
        assert shapes[rid]["num_cached_tokens"] == cached, rid
    st = r["shapes/on"]["stats"]
    assert st["prompt_tokens"] == 30 + sum(len(p) for p, _ in SHAPES.values())
    assert st["cached_prompt_tokens"] == sum(c for _, c in SHAPES.values())
    pre = by_id(r["preempt/on"])
    assert r["preempt/on"]["stats"]["num_preemptions"] > 0  # sharers were preempted ...
    assert sorted(o["num_cached_tokens"] for o in pre.values()) == [0] + [16] * 7  # ... usage counts once
    # ... and their re-prefills found their computed blocks cached: fewer tokens run than with caching off
    assert r["preempt/on"]["stats"]["computed_tokens"] < r["preempt/off"]["stats"]["computed_tokens"]
    assert r["preempt/off"]["stats"]["num_preemptions"] > 0
    ev = by_id(r["evict/on"])
    assert [ev[f"a{i}"]["num_cached_tokens"] for i in range(4)] == [0, 12, 12, 12]
    assert [ev[f"again{i}"]["num_cached_tokens"] for i in range(2)] == [0, 12]  # wave b evicted qa's blocks
    again = by_id(r["chunked-cached/on"])["c0again"]
    assert again["num_cached_tokens"] == 36  # 37 tokens: 9 whole blocks found, the last token computed
    assert r["chunked/on"]["stats"]["prefill_steps"] > 5  # the 60-token prompt took 4+ chunk steps


@pytest.mark.parametrize("tp", (1, 2))
def test_smollm2_chat_prompts_share_the_system_prompt(results, tp):
    on = by_id(results[tp]["smollm2/on"])
    cached = [o["num_cached_tokens"] for o in on.values()]
    assert min(cached) == 0 and sorted(cached)[1] > 0  # all but the first find the template's prefix
    st = results[tp]["smollm2/on"]["stats"]
    assert 0 < st["cached_prompt_tokens"] == sum(cached) < st["prompt_tokens"]


def test_6000_token_prompt_chunked_at_tp2_equals_whole(results):
    chunked, whole = by_id(results[2]["long/chunked"]), by_id(results[2]["long/whole"])
    assert len(chunked["long"]["token_ids"]) == 8 and len(chunked["short"]["token_ids"]) == 40
    for rid in ("long", "short"):
        assert chunked[rid]["token_ids"] == whole[rid]["token_ids"], rid
    st_c, st_w = results[2]["long/chunked"]["stats"], results[2]["long/whole"]["stats"]
    # chunked: step 1 = short's prompt + 492 tokens, then 11 mixed steps (short's decode + 511 tokens)
    # until long samples; short (40 tokens) never waits: 40 steps in all
    assert (st_c["prefill_steps"], st_c["steps"]) == (12, 40)
    assert (st_w["prefill_steps"], st_w["steps"]) == (1, 40)  # whole: both prompts in one 6020-token step


def test_chunked_prefill_in_bfloat16_runs_every_request(results):
    out = by_id(results[1]["chunked-bf16"])
    assert sorted(out) == ["c0", "c0again", "c1", "c2", "c3", "c4"]
    assert all(o["error"] is None and len(o["token_ids"]) == 10 for o in out.values())
    assert out["c0again"]["num_cached_tokens"] == 36
    assert results[1]["chunked-bf16"]["stats"]["prefill_steps"] > 5


@pytest.mark.parametrize("tp", (1, 2))
def test_seeded_sampling_survives_chunks_cache_hits_and_preemption(results, tp):
    on = by_id(results[tp]["seeded/on"])
    assert results[tp]["seeded/on"]["stats"]["num_preemptions"] > 0
    assert on["r0twin"]["token_ids"] == on["r0"]["token_ids"] and on["r0twin"]["num_cached_tokens"] == 16
    assert len({tuple(o["token_ids"]) for o in on.values()}) == 5  # the others differ
