"""Speculative decoding through the real engine (issue 39), SmolLM2 in float32, at tp 1 and 2: with
n-gram proposals every greedy and seeded output (penalties, logprobs, stop strings, min_tokens, n = 2,
a structured output beside them, prefix-cache hits) is token for token the one without speculation,
and so it stays with chunked prefill and preemption in play; proposals were made and accepted, the
counters agree with each other, every KV block comes back; the batch job takes vLLM's
``--speculative-config`` and its summary and records carry the counts. A draft model (SmolLM2 itself,
and its first 6 layers) gives the same outputs; one with another vocabulary is refused at load."""

from __future__ import annotations

import json

import pytest
from conftest import SMOLLM2_DIR
from launch import NO_MEASURING, run_engine_jobs

pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

# the measured linear layouts (cached per machine; a busy machine's default): float32 greedy tokens do not
# depend on the layout (test_engine: each layout equals HF at every tp), and tp=2 runs are compared with
# tp=1's whatever the layouts
BASE = {"model": str(SMOLLM2_DIR), "dtype": "float32", "max_model_len": 512, "kv_cache_gb": 0.2}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "disable_by_batch_size": 64}  # a fixed rule, so the test does not depend on this machine's timings
#: chunks of 48 tokens beside the decodes, and a cache too small for every sequence at once (preemption)
TIGHT = {"max_num_batched_tokens": 48, "num_kv_blocks": 20}
TEXT = ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "def fact(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out\n")


def _chat(tok, q: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"])


def _requests(tok) -> list:
    copy = _chat(tok, "Repeat this code exactly, then stop:\n" + TEXT)
    return [
        ["copy", copy, {"temperature": 0.0, "max_tokens": 64}],
        ["copy-seeded", copy, {"temperature": 0.8, "seed": 11, "presence_penalty": 0.3, "frequency_penalty": 0.2,
                               "logprobs": 2, "max_tokens": 48}],
        ["count", _chat(tok, "Count from 1 to 30, separated by commas."),
         {"temperature": 0.0, "max_tokens": 80, "stop": ["12"], "min_tokens": 5}],
        ["n2", copy, {"temperature": 0.7, "top_p": 0.9, "seed": 5, "n": 2, "max_tokens": 32}],
        ["choice", _chat(tok, "Is the sea salty?"), {"temperature": 0.0, "max_tokens": 8,
                                                     "structured_outputs": {"choice": ["yes", "no"]}}],
        ["shared", _chat(tok, "Repeat this code exactly, then stop:\n" + TEXT + "\nAnd then say done."),
         {"temperature": 0.0, "max_tokens": 64, "repetition_penalty": 1.1}],
        ["eos", _chat(tok, "Write the word ok."), {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}],
    ]


def _draft_jobs(tok, tmp) -> list[dict]:
    """SmolLM2 with itself as draft (the mechanism's cost at its best: every proposal right) and with
    a truncated copy (its first 6 layers and its head: a weak draft), written under ``tmp``."""
    import sys

    from launch import REPO

    sys.path.insert(0, str(REPO))
    from benchmarks.truncate_model import truncate

    weak = truncate(SMOLLM2_DIR, 6, tmp / "smollm2-6l")
    reqs = [r for r in _requests(tok) if r[0] != "shared"]
    return [{"key": name, "requests": reqs, "config": {**BASE, "speculative_config": {
        "model": str(model), "num_speculative_tokens": 3, "disable_by_batch_size": 64}}}
        for name, model in (("self", SMOLLM2_DIR), ("weak", weak))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every engine run of this module, one launch per tp (1 and 2): n-gram speculation ("spec", and
    "tight": chunked prefill and preemption), the draft models ("self", "weak": :func:`_draft_jobs`) and,
    at tp 1, the same without speculation ("base", "tight-base"): tp -> key -> (outputs by id, job)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tmp = tmp_path_factory.mktemp("spec")
    reqs = _requests(tok)
    drafts = _draft_jobs(tok, tmp)
    out = {}
    for tp in (1, 2):
        jobs = [{"key": "spec", "config": {**BASE, "speculative_config": SPEC}, "requests": reqs},
                {"key": "tight", "config": {**BASE, **TIGHT, "speculative_config": SPEC}, "requests": reqs}]
        if tp == 1:
            jobs += [{"key": "base", "config": BASE, "requests": reqs},
                     {"key": "tight-base", "config": {**BASE, **TIGHT}, "requests": reqs}]
        res = run_engine_jobs(tmp, tp, jobs + drafts, env=NO_MEASURING)  # every load the same default layouts
        out[tp] = {k: ({o["request_id"]: o for o in v["outputs"]}, v) for k, v in res.items()}
    return out


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert w["error"] is None, w["error"]
        assert [o["token_ids"] for o in g["outputs"]] == [o["token_ids"] for o in w["outputs"]], rid
        assert [o["text"] for o in g["outputs"]] == [o["text"] for o in w["outputs"]], rid
        assert [o["finish_reason"] for o in g["outputs"]] == [o["finish_reason"] for o in w["outputs"]], rid
        for go, wo in zip(g["outputs"], w["outputs"]):
            if wo["logprobs"] is not None:
                assert len(go["logprobs"]) == len(wo["logprobs"])
                for gp, wp in zip(go["logprobs"], wo["logprobs"]):
                    assert gp["chosen"]["token_id"] == wp["chosen"]["token_id"]
                    assert gp["chosen"]["logprob"] == pytest.approx(wp["chosen"]["logprob"], abs=1e-4), rid


@pytest.mark.parametrize("tp", [1, 2])
def test_outputs_equal_those_without_speculation(results, tp):
    base = results[1]["base"][0]
    _same(results[tp]["spec"][0], base)
    count = base["count"]
    assert count["finish_reason"] == "stop" and count["text"].endswith("11. 11\n"), count["text"]
    assert len(base["eos"]["token_ids"]) == 40 and len(base["n2"]["outputs"]) == 2
    assert base["choice"]["text"] in ("yes", "no")


@pytest.mark.parametrize("tp", [1, 2])
def test_with_chunked_prefill_and_preemption(results, tp):
    want, stats = results[1]["tight-base"]
    assert stats["stats"]["num_preemptions"] > 0  # the cache is too small: preemption is in play
    got, spec = results[tp]["tight"]
    _same(got, want)
    assert spec["stats"]["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_proposals_were_made_and_counted(results, tp):
    outs, job = results[tp]["spec"]
    s = job["stats"]
    assert s["speculative"] and s["spec_num_drafts"] > 0
    assert 0 < s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"] <= 4 * s["spec_num_drafts"]
    per_pos = s["spec_accepted_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == s["spec_num_accepted_tokens"]
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position j is reached only through j - 1
    # fewer steps than tokens: some steps emitted several tokens per sequence
    assert s["decode_steps"] < s["output_tokens"] - s["prefill_steps"]
    assert outs["copy"]["spec_num_accepted_tokens"] > 0
    assert outs["choice"]["spec_num_draft_tokens"] == 0  # a structured output gets no proposals
    assert sum(o["spec_num_draft_tokens"] for o in outs.values()) == s["spec_num_draft_tokens"]
    assert sum(o["spec_num_accepted_tokens"] for o in outs.values()) == s["spec_num_accepted_tokens"]
    assert s["num_free_blocks"] == job["start_free_blocks"]  # every block came back (trimmed or freed)
    assert results[1]["base"][0]["copy"]["spec_num_draft_tokens"] is None


def test_batch_job_takes_the_flag_and_reports(tmp_path):
    from test_cli import write_jsonl
    from test_job_files import run_cli

    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3",
         "max_tokens": 24, "temperature": 0.0}])
    out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
    code, err = run_cli("--prompts", prompts, "--model", SMOLLM2_DIR, "--dtype", "float32", "--out", out,
                        "--summary-json", summary, "--max-model-len", 256,
                        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_max": 3, "disable_by_batch_size": 8}))
    assert code == 0, err
    record = json.loads(out.read_text())
    spec = json.loads(summary.read_text())["spec_decode"]
    assert spec["num_draft_tokens"] == record["metrics"]["spec_num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == record["metrics"]["spec_num_accepted_tokens"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    assert "speculative decoding" in err
    code, err = run_cli("--prompts", prompts, "--model", SMOLLM2_DIR, "--out", tmp_path / "o2.jsonl",
                        "--speculative-config", '{"method": "ngram"}')
    assert code == 2 and "invalid speculative_config: num_speculative_tokens is required" in err


@pytest.fixture(scope="module")
def draft_results(results):
    """The draft-model runs ("self", "weak") at tp 1 and 2, made in :func:`results`' launches."""
    return {tp: {k: results[tp][k] for k in ("self", "weak")} for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("draft", ["self", "weak"])
def test_draft_model_outputs_equal_those_without_speculation(results, draft_results, tp, draft):
    base = {k: v for k, v in results[1]["base"][0].items() if k != "shared"}
    got, job = draft_results[tp][draft]
    _same(got, base)
    s = job["stats"]
    rates = {rid: o["spec_num_accepted_tokens"] / o["spec_num_draft_tokens"] for rid, o in got.items()
             if o["spec_num_draft_tokens"]}
    if draft == "self":  # the draft is the model: a plain greedy request takes nearly every proposal
        assert rates["copy"] > 0.9 and rates["count"] > 0.9, rates
    else:  # six layers of thirty: still right on the copied text
        assert rates["copy"] > 0, rates
    assert s["num_free_blocks"] == job["start_free_blocks"]
    assert got["choice"]["spec_num_draft_tokens"] == 0


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from conftest import make_tiny_model
    from test_cli import write_jsonl
    from test_job_files import run_cli

    tiny = make_tiny_model(tmp_path, vocab_size=1001)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi", "max_tokens": 2}])
    code, err = run_cli("--prompts", prompts, "--model", SMOLLM2_DIR, "--out", tmp_path / "o.jsonl",
                        "--speculative-config", json.dumps({"model": str(tiny), "num_speculative_tokens": 2}))
    assert code == 2, err
    assert (f"failed: UserError: speculative_config model {tiny}: its vocabulary has 1001 tokens, the model's 49152; "
            "a draft model must share the model's vocabulary") in err
