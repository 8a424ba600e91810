"""The logits processors and logprobs through the real engine at tp 1 and 2, against Hugging Face
in float32: greedy with ``repetition_penalty``, ``min_tokens`` and ``logit_bias`` equals
``generate(repetition_penalty=, min_new_tokens=, sequence_bias=)`` token for token, on SmolLM2 and
a tiny Qwen3; logprobs (top 5) and prompt logprobs equal HF's ``log_softmax`` of its logits within
1e-4 (a chunked prefill and a prefix-cache hit included); a seeded request samples the same tokens
alone and batched with penalty / bias requests. One torchrun launch per tp size."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMOLLM2_DIR, make_tiny_model
from launch import torchrun

EOS = 2  # SmolLM2's <|im_end|>: the tokenizer's EOS, the engine's EOS id for both models
TOL = 1e-4
# (key, params beyond greedy, HF generate kwargs) for each model; BIAS_ID is set per model
CASES = {
    "rep": ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    "min": ({"min_tokens": 5, "logit_bias": {EOS: 100.0}}, {"min_new_tokens": 5, "sequence_bias": {(EOS,): 100.0}}),
    "all": ({"repetition_penalty": 0.8, "min_tokens": 3, "logit_bias": {"BIAS": 4.0, EOS: 3.0}},
            {"repetition_penalty": 0.8, "min_new_tokens": 3, "sequence_bias": {("BIAS",): 4.0, (EOS,): 3.0}}),
}
MAX_NEW = 8


def _sub(d: dict, bias_id: int) -> dict:
    """``d`` with the "BIAS" placeholder (a key or a one-token tuple) replaced by ``bias_id``."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = {(bias_id if x == "BIAS" else x) if not isinstance(x, tuple) else
                 tuple(bias_id if t == "BIAS" else t for t in x): y for x, y in v.items()}
        out[k] = v
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("sampling-models")
    qwen3 = make_tiny_model(root, "qwen3", seed=4, name="qwen3", head_dim=32, random_biases=True)
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    chat = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"])
            for q in ("Say yes.", "Name three colors.")]
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (9, 40)]
    models = {"smollm2": (SMOLLM2_DIR, chat, tok.encode(" the")[0]), "qwen3": (qwen3, rand, 17)}
    return models


def _jobs(models) -> list[dict]:
    jobs = []
    for name, (d, prompts, bias_id) in models.items():
        base = {"model": str(d), "max_model_len": 256, "kv_cache_gb": 0.1}
        reqs = [[f"{key}{i}", p, {"temperature": 0.0, "max_tokens": MAX_NEW, **_sub(params, bias_id)}]
                for key, (params, _) in CASES.items() for i, p in enumerate(prompts)]
        reqs += [[f"lp{i}", p, {"temperature": 0.0, "max_tokens": 6, "logprobs": 5, "prompt_logprobs": 5}]
                 for i, p in enumerate(prompts)]
        reqs.append(["sampled", prompts[1], {"temperature": 1.5, "seed": 11, "max_tokens": 8, "logprobs": 2,
                                             "ignore_eos": True}])
        reqs += [[f"score{i}", p, {"max_tokens": 0, "prompt_logprobs": 3, "n": 2, "logprobs": 1, "temperature": 1.0}]
                 for i, p in enumerate(prompts)]
        jobs.append({"key": name, "config": base, "requests": reqs})
    d, prompts, _ = models["qwen3"]
    base = {"model": str(d), "max_model_len": 256, "kv_cache_gb": 0.1}
    lp = {"temperature": 0.0, "max_tokens": 4, "logprobs": 3, "prompt_logprobs": 2}
    # a 40-token prompt prefilled in 16-token chunks; then, cached, asked again with prompt logprobs
    jobs.append({"key": "qwen3/chunked", "config": {**base, "max_num_batched_tokens": 16},
                 "requests": [["chunked", prompts[1], lp]]})
    jobs.append({"key": "qwen3/cached", "config": base,
                 "waves": [[["warm", prompts[1], {"temperature": 0.0, "max_tokens": 2}]], [["again", prompts[1], lp]]]})
    seeded = ["seeded", prompts[0], {"temperature": 0.9, "seed": 3, "max_tokens": 12, "ignore_eos": True,
                                     "repetition_penalty": 1.1}]
    others = [[f"o{i}", prompts[i % 2], {"temperature": t, "max_tokens": 12, **extra}]
              for i, (t, extra) in enumerate([(0.0, {"logit_bias": {"5": 2.0}}), (1.0, {"presence_penalty": 1.0}),
                                              (0.7, {"frequency_penalty": 0.5, "min_tokens": 4})])]
    jobs.append({"key": "qwen3/seed-alone", "config": base, "requests": [seeded]})
    jobs.append({"key": "qwen3/seed-batched", "config": base, "requests": [others[0], seeded, *others[1:]]})
    return jobs


@pytest.fixture(scope="module")
def results(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampling-runs")
    jobs = _jobs(setup)
    for job in jobs:  # JSON keys are strings; the worker turns logit_bias keys back into ints
        for reqs in job.get("waves", [job.get("requests", [])]):
            for r in reqs:
                if "logit_bias" in r[2]:
                    r[2]["logit_bias"] = {str(k): v for k, v in r[2]["logit_bias"].items()}
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    out = {}
    for tp in (1, 2):
        torchrun("engine_generate.py", tp, [str(tmp / f"out{tp}.json"), str(tmp / "jobs.json")])
        out[tp] = {k: {o["request_id"]: o for o in v["outputs"]} for k, v in
                   json.loads((tmp / f"out{tp}.json").read_text()).items()}
    return out


@pytest.fixture(scope="module")
def hf(setup):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for name, (d, _, _) in setup.items()}


_FORWARDS: dict[tuple, torch.Tensor] = {}


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """HF's float32 ``log_softmax`` of its logits over ``ids``: ``[len(ids), V]``, row p predicting
    token p + 1 (kept per model and ids: both tp sizes ask for the same ones)."""
    key = (id(model), tuple(ids))
    if key not in _FORWARDS:
        with torch.inference_mode():
            _FORWARDS[key] = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return _FORWARDS[key]


def _check_position(got: dict, want: torch.Tensor, token: int, k: int) -> None:
    """An engine PositionLogprobs (as a dict) against HF's log-softmax row ``want [V]``."""
    assert got["chosen"]["token_id"] == token
    assert got["chosen"]["logprob"] == pytest.approx(float(want[token]), abs=TOL)
    # rank: 1 + tokens strictly more likely; HF's row decides it up to tokens within TOL of the chosen one
    lo, hi = (1 + int((want > want[token] + d).sum()) for d in (TOL, -TOL))
    assert lo <= got["chosen"]["rank"] <= hi, (got["chosen"]["rank"], lo, hi)
    top_lp, top_ids = torch.topk(want, k)
    assert [t["logprob"] for t in got["top"]] == pytest.approx(top_lp.tolist(), abs=TOL)
    assert [t["rank"] for t in got["top"]] == list(range(1, k + 1))
    assert {t["token_id"] for t in got["top"]} == set(top_ids.tolist())  # equal up to order of near-ties


@pytest.fixture(scope="module")
def hf_generated(setup, hf) -> dict[str, dict[str, list[int]]]:
    """HF ``generate`` for each model and case: request id -> generated ids (EOS included)."""
    out = {}
    with torch.inference_mode():
        for name, (_, prompts, bias_id) in setup.items():
            out[name] = {f"{key}{i}": hf[name].generate(
                torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS,
                **_sub(kwargs, bias_id))[0, len(p):].tolist()
                for key, (_, kwargs) in CASES.items() for i, p in enumerate(prompts)}
    return out


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_greedy_processors_equal_hf_generate(setup, hf_generated, results, name, tp):
    _, prompts, _ = setup[name]
    got = results[tp][name]
    for rid, want in hf_generated[name].items():
        assert got[rid]["token_ids"] == want, rid
    for i in range(len(prompts)):  # min_tokens 5 with EOS biased +100: EOS exactly after 5 tokens
        assert got[f"min{i}"]["token_ids"][5:] == [EOS] and got[f"min{i}"]["finish_reason"] == "stop"


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_logprobs_and_prompt_logprobs_equal_hf(setup, hf, results, name, tp):
    _, prompts, _ = setup[name]
    got = results[tp][name]
    for i, p in enumerate(prompts):
        o = got[f"lp{i}"]
        out_ids = o["token_ids"]
        want = _hf_logprobs(hf[name], p + out_ids)
        lps = o["outputs"][0]["logprobs"]
        assert len(lps) == len(out_ids) > 0
        for t, (lp, tok) in enumerate(zip(lps, out_ids)):
            _check_position(lp, want[len(p) - 1 + t], tok, 5)
            assert lp["chosen"]["rank"] == 1  # greedy
        assert o["outputs"][0]["cumulative_logprob"] == pytest.approx(
            sum(float(want[len(p) - 1 + t, tok]) for t, tok in enumerate(out_ids)), abs=10 * TOL)
        pl = o["prompt_logprobs"]
        assert len(pl) == len(p) and pl[0] is None
        for j in range(1, len(p)):
            _check_position(pl[j], want[j - 1], p[j], 5)
    s = got["sampled"]  # a sampled token's rank: 1 + tokens strictly more likely, from the raw logits
    want = _hf_logprobs(hf[name], prompts[1] + s["token_ids"])
    for t, (lp, tok) in enumerate(zip(s["outputs"][0]["logprobs"], s["token_ids"])):
        _check_position(lp, want[len(prompts[1]) - 1 + t], tok, 2)
    assert len(s["token_ids"]) == 8


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_max_tokens_0_scores_the_prompt_and_generates_nothing(setup, hf, results, name, tp):
    """``max_tokens`` 0 (vLLM's echo scoring): n empty samples ending "length", logprobs [] when
    asked, and the prompt logprobs of HF's float32 ``log_softmax``."""
    _, prompts, _ = setup[name]
    for i, p in enumerate(prompts):
        o = results[tp][name][f"score{i}"]
        assert [(s["index"], s["text"], s["token_ids"], s["finish_reason"], s["logprobs"])
                for s in o["outputs"]] == [(0, "", [], "length", []), (1, "", [], "length", [])]
        want = _hf_logprobs(hf[name], p)
        pl = o["prompt_logprobs"]
        assert len(pl) == len(p) and pl[0] is None
        for j in range(1, len(p)):
            _check_position(pl[j], want[j - 1], p[j], 3)


@pytest.mark.parametrize("tp", (1, 2))
def test_prompt_logprobs_chunked_and_past_the_prefix_cache(setup, hf, results, tp):
    """A 40-token prompt in 16-token chunks, and the same prompt after it is in the prefix cache:
    every position's prompt logprobs, equal to HF's (such a request computes every position)."""
    _, prompts, _ = setup["qwen3"]
    p = prompts[1]
    for key, rid in (("qwen3/chunked", "chunked"), ("qwen3/cached", "again")):
        o = results[tp][key][rid]
        want = _hf_logprobs(hf["qwen3"], p + o["token_ids"])
        assert o["num_cached_tokens"] == 0
        pl = o["prompt_logprobs"]
        assert len(pl) == len(p) == 40 and pl[0] is None
        for j in range(1, len(p)):
            _check_position(pl[j], want[j - 1], p[j], 2)
        for t, (lp, tok) in enumerate(zip(o["outputs"][0]["logprobs"], o["token_ids"])):
            _check_position(lp, want[len(p) - 1 + t], tok, 3)
    assert results[tp]["qwen3/cached"]["warm"]["num_cached_tokens"] == 0


@pytest.mark.parametrize("tp", (1, 2))
def test_seeded_request_same_alone_and_batched_with_penalties(results, tp):
    alone = results[tp]["qwen3/seed-alone"]["seeded"]["token_ids"]
    assert len(alone) == 12 and len(set(alone)) > 3
    assert results[tp]["qwen3/seed-batched"]["seeded"]["token_ids"] == alone
    assert results[1]["qwen3/seed-alone"]["seeded"]["token_ids"] == alone  # and at every tp size
