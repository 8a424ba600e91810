"""Sliding-window KV memory through the engine (tpengine.engine.block_manager's window freeing): a tiny
Mistral whose every layer slides (window 8, blocks of 4 tokens) generates sequences several times longer
than its whole KV cache, with prefix caching and chunked prefill, at tp 1 and 2, token for token equal
to HF greedy and without a preemption; a prompt that shares a prefix whose first blocks left the window
runs over a table with -1 entries; n-gram speculation with preemption and recompute at tp 2. Gemma 2
(full and sliding layers) frees nothing. (Block-level rules: test_sliding_window_kv.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from hf_reference import greedy
from launch import run_engine_jobs

LONG_NEW, SHORT_NEW = 40, 8
W, B = 8, 4  # the Mistral's window, the block size
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 64}


def prompts() -> list[list[int]]:
    """Two prompts for the long generations, a third of 24 tokens and a fourth sharing its first 20 (five
    blocks of 4: a prefix-cache hit whose first three blocks lie before the window of its first computed
    position, 20), and a fifth that repeats itself (the n-gram proposer always drafts)."""
    g = torch.Generator().manual_seed(11)
    a, b, c = (torch.randint(3, 1001, (n,), generator=g).tolist() for n in (20, 13, 24))
    return [a, b, c, c[:20] + torch.randint(3, 1001, (6,), generator=g).tolist(), [7, 8, 9, 10] * 5]


def req(i: int, new: int) -> list:
    return [f"p{i}", prompts()[i], {"temperature": 0.0, "max_tokens": new, "ignore_eos": True}]


WAVES = [[req(0, LONG_NEW), req(1, LONG_NEW)], [req(2, SHORT_NEW)], [req(3, SHORT_NEW)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    return {"mistral": make_tiny_model(root, "mistral", name="mistral", seed=4, random_biases=True,
                                       sliding_window=W),
            "gemma2": make_tiny_model(root, "gemma2", name="gemma2", seed=4, random_biases=True,
                                      tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def hf(models):
    """HF's greedy continuations of the Mistral (Gemma 2's through the engine: test_families.py)."""
    news = [LONG_NEW, LONG_NEW, SHORT_NEW, SHORT_NEW, LONG_NEW]
    return [greedy(models["mistral"], [p], n, stop_at_eos=False, attn="eager", batched=False)[0]
            for p, n in zip(prompts(), news)]


def cfg(d, **kw) -> dict:
    # blocks of 4 tokens, chunks of 16: a long sequence (60 tokens) needs 15 blocks
    return {"model": str(d), "dtype": "float32", "max_model_len": 128, "block_size": B, "max_num_batched_tokens": 16,
            "cpu_linear": "plain", **kw}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sliding-runs")
    out = {}
    for tp in (1, 2):
        jobs = [{"key": "mistral/long", "config": cfg(models["mistral"], num_kv_blocks=10), "waves": WAVES}]
        if tp == 1:  # every block of every sequence kept: 2 x 20 blocks at once
            jobs.append({"key": "gemma2/long", "config": cfg(models["gemma2"], num_kv_blocks=48), "waves": WAVES})
        else:  # speculation, and a cache too small for the five at once: preempted sequences recompute in chunks
            spec = cfg(models["mistral"], num_kv_blocks=9, speculative_config=SPEC)
            jobs.append({"key": "mistral/spec", "config": spec,
                         "requests": [req(0, LONG_NEW), req(1, LONG_NEW), req(2, SHORT_NEW), req(3, SHORT_NEW),
                                      req(4, LONG_NEW)]})
        out[tp] = run_engine_jobs(tmp, tp, jobs, tag="-sliding")
    return out


def tokens(job: dict) -> dict[str, list[int]]:
    return {o["request_id"]: o["token_ids"] for o in job["outputs"]}


@pytest.mark.parametrize("tp", (1, 2))
def test_long_generation_in_a_small_cache_equals_hf(hf, results, tp):
    """60- and 53-token sequences, two at once, in 10 blocks of 4 (40 tokens): every token HF's, no
    preemption, each block freed once it left the window of the last query that needed it; the fourth
    prompt's 20 shared tokens come from the cache, the three blocks before its window never taken."""
    job = results[tp]["mistral/long"]
    got = tokens(job)
    assert [got[f"p{i}"] for i in range(4)] == hf[:4]
    stats = job["stats"]
    assert stats["num_preemptions"] == 0, stats
    assert stats["cached_prompt_tokens"] == 20, stats
    # a sequence of n tokens last computes position n - 2: the blocks before (n - 2 - W + 1) // B are gone
    gone = [(len(prompts()[i]) + new - 2 - W + 1) // B for i, new in enumerate((LONG_NEW, LONG_NEW, SHORT_NEW))]
    gone.append((len(prompts()[3]) + SHORT_NEW - 2 - W + 1) // B - (20 - W + 1) // B)  # its hits before 20's window
    assert job["window_freed"] == sum(gone), (job["window_freed"], gone)
    assert stats["num_free_blocks"] == 10


def test_mixed_model_frees_nothing(results):
    """Gemma 2 (sliding and full layers) keeps every block of a sequence until it ends: nothing freed."""
    job = results[1]["gemma2/long"]
    assert [len(o["token_ids"]) for o in job["outputs"]] == [LONG_NEW, LONG_NEW, SHORT_NEW, SHORT_NEW]
    assert job["window_freed"] == 0 and job["stats"]["num_preemptions"] == 0
    assert job["stats"]["cached_prompt_tokens"] == 20  # the whole shared prefix, every block of it


def test_speculation_and_preemption_equal_hf(hf, results):
    job = results[2]["mistral/spec"]
    got = tokens(job)
    assert [got[f"p{i}"] for i in range(5)] == hf
    stats = job["stats"]
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert job["window_freed"] > 0
