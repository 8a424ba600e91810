"""Structured outputs through the real engine (issue 37), SmolLM2 in float32: greedy JSON-schema
outputs all validate (``jsonschema``) and are token for token the same at tp 1, 2 and 3 (the mask
is applied to rank 0's full-vocabulary rows); choice and regex outputs match; seeded constrained
samples are the same at tp 1 and 2; an n = 2 request gets two valid samples; a schema the library
refuses is that request's error output while the others run; an unconstrained request batched with
constrained ones gives what it gives alone; the guidance backend's outputs validate too."""

from __future__ import annotations

import json
import re
import sys

import pytest
from conftest import SMOLLM2_DIR
from launch import NO_MEASURING, REPO, run_engine_jobs

sys.path.insert(0, str(REPO))
from benchmarks.structured_schemas import SCHEMAS  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

GREEDY = SCHEMAS[:10]
SEEDED = SCHEMAS[10:15]
REGEX = r"[0-9]{3}-[0-9]{4}"
# the measured linear layouts (cached per machine): float32 greedy tokens do not depend on the layout
# (test_engine's subject: each layout, and the measured one, equal HF at every tp)
BASE = {"model": str(SMOLLM2_DIR), "dtype": "float32", "max_model_len": 1024, "kv_cache_gb": 0.2}


def _chat(tok, q: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"])


def _requests(tok) -> list:
    reqs = [[f"g{i}", _chat(tok, q), {"temperature": 0.0, "max_tokens": 256, "structured_outputs": {"json": s}}]
            for i, (q, s) in enumerate(GREEDY)]
    reqs += [[f"s{i}", _chat(tok, q), {"temperature": 0.8, "seed": 100 + i, "max_tokens": 256, "structured_outputs": {
        "json": s, "disable_any_whitespace": True}}] for i, (q, s) in enumerate(SEEDED)]
    reqs += [["choice", _chat(tok, "Is the sea salty?"), {"temperature": 0.0, "max_tokens": 8,
                                                           "structured_outputs": {"choice": ["yes", "no", "maybe"]}}],
             ["regex", _chat(tok, "A phone number?"), {"temperature": 0.0, "max_tokens": 16,
                                                       "structured_outputs": {"regex": REGEX}}],
             ["n2", _chat(tok, "Any JSON object."), {"temperature": 1.0, "seed": 3, "n": 2, "max_tokens": 128,
                                                     "structured_outputs": {"json": GREEDY[0][1],
                                                                            "disable_any_whitespace": True}}],
             ["bad", _chat(tok, "x"), {"temperature": 0.0, "structured_outputs": {"json": {"type": "bogus"}}}],
             ["plain", _chat(tok, "Say hello."), {"temperature": 0.0, "max_tokens": 12}]]
    return reqs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tmp = tmp_path_factory.mktemp("structured")
    reqs = _requests(tok)
    plain = [r for r in reqs if r[0] == "plain"]
    out = {}
    for tp in (1, 2, 3):
        jobs = [{"key": "mixed", "config": BASE, "requests": reqs}]
        if tp == 1:
            jobs += [{"key": "alone", "config": BASE, "requests": plain},
                     {"key": "guidance", "config": {**BASE, "structured_outputs_backend": "guidance"},
                      "requests": reqs[: len(GREEDY)]}]
        res = run_engine_jobs(tmp, tp, jobs, env=NO_MEASURING)  # every load the same default layouts
        out[tp] = {k: {o["request_id"]: o for o in v["outputs"]} for k, v in res.items()}
    return out


def _valid(text: str, schema: dict) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(json.loads(text))


def test_greedy_schema_outputs_validate_and_are_the_same_at_every_tp(results):
    for i, (_, schema) in enumerate(GREEDY):
        o = results[1]["mixed"][f"g{i}"]
        assert o["finish_reason"] == "stop", o["text"]
        _valid(o["text"], schema)
        for tp in (2, 3):
            assert results[tp]["mixed"][f"g{i}"]["token_ids"] == o["token_ids"], (tp, i)


def test_seeded_samples_validate_and_are_the_same_at_tp_1_and_2(results):
    for i, (_, schema) in enumerate(SEEDED):
        o = results[1]["mixed"][f"s{i}"]
        assert o["finish_reason"] == "stop", o["text"]
        _valid(o["text"], schema)
        assert results[2]["mixed"][f"s{i}"]["token_ids"] == o["token_ids"], i
    n2 = results[1]["mixed"]["n2"]
    assert len(n2["outputs"]) == 2
    for sample in n2["outputs"]:
        assert sample["finish_reason"] == "stop"
        _valid(sample["text"], GREEDY[0][1])


def test_choice_and_regex_match(results):
    for tp in (1, 2, 3):
        got = results[tp]["mixed"]
        assert got["choice"]["text"] in ("yes", "no", "maybe") and got["choice"]["finish_reason"] == "stop"
        assert re.fullmatch(REGEX, got["regex"]["text"]), got["regex"]["text"]
    assert results[2]["mixed"]["choice"]["text"] == results[1]["mixed"]["choice"]["text"]


def test_a_bad_schema_is_its_own_error_and_others_are_untouched(results):
    for tp in (1, 2, 3):
        bad = results[tp]["mixed"]["bad"]
        assert bad["error"] == ('cannot compile the JSON schema: xgrammar: Unsupported type "bogus"; '
                                "guidance: Invalid type: bogus")
        assert bad["error_field"] == "structured_outputs"
    assert results[1]["mixed"]["plain"]["token_ids"] == results[1]["alone"]["plain"]["token_ids"]


def test_the_guidance_backend(results):
    for i, (_, schema) in enumerate(GREEDY):
        o = results[1]["guidance"][f"g{i}"]
        assert o["finish_reason"] == "stop", o["text"]
        _valid(o["text"], schema)
