"""vLLM's semantics through the request parser (chat max_tokens, stream, neutral values by type, text
parts, batched prompts), ``iter_requests`` streaming a file line by line, and lines json cannot build."""

from __future__ import annotations

import itertools
import json

from test_requests import DEFAULTS, batch, one_error, parse

from tpengine.frontend.requests import iter_requests, parse_lines, parse_requests

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def test_max_tokens_precedence_line_then_defaults_then_format():
    """Chat runs to the rest of the context (None: until EOS or max_model_len); completions and
    simple lines keep 16; the caller's defaults (config [sampling], --max-tokens) come before."""
    lines = [batch("chat", CHAT, {"messages": MSGS}),
             batch("chat9", CHAT, {"messages": MSGS, "max_tokens": 9}),
             batch("comp", "/v1/completions", {"prompt": "x"}),
             {"id": "simple", "prompt": "x"},
             {"id": "smsg", "messages": MSGS}]
    got = {r.id: r.params.max_tokens for r in parse(*lines, defaults={})[0]}
    assert got == {"chat": None, "chat9": 9, "comp": 16, "simple": 16, "smsg": 16}
    got = {r.id: r.params.max_tokens for r in parse(*lines, defaults={"max_tokens": 7})[0]}
    assert got == {"chat": 7, "chat9": 9, "comp": 7, "simple": 7, "smsg": 7}
    (r,), _ = parse(batch("c", CHAT, {"messages": MSGS, "max_tokens": None, "max_completion_tokens": None}),
                    defaults={"temperature": 0.0})
    assert (r.params.max_tokens, r.params.temperature) == (None, 0.0)


def test_vllm_semantics_through_parse_lines():
    stream = ("streaming is not supported in a batch job (each request gets one complete record); "
              "use false or omit it, got true")
    cases = [
        (batch("a", CHAT, {"messages": MSGS, "stream": True}), "body.stream", stream),
        ({"prompt": "x", "stream": True}, "stream", stream),
        (batch("b", CHAT, {"messages": MSGS, "logprobs": 0}), "body.logprobs", "must be true or false, got 0"),
        (batch("c", CHAT, {"messages": MSGS, "n": True}), "body.n", "must be an integer >= 1, got true"),
        (batch("f", CHAT, {"messages": MSGS, "top_logprobs": 1}), "body.top_logprobs",
         'needs "logprobs": true, got "logprobs": null'),
        (batch("d", CHAT, {"messages": MSGS, "max_tokens": -5, "max_completion_tokens": 3}), "body.max_tokens",
         "must be an integer >= 0 (0: score the prompt only), got -5"),
        (batch("e", "/v1/completions", {"prompt": ["a", "b"]}), "body.prompt",
         "a batch line holds one prompt (send one line per prompt, so that each gets its own record, id and "
         "--resume entry), got a list of 2 prompts"),
        (batch("g", "/v1/completions", {"prompt": [[1, 2], [3]]}), "body.prompt",
         "a batch line holds one prompt (send one line per prompt, so that each gets its own record, id and "
         "--resume entry), got a list of 2 prompts"),
    ]
    for obj, field, msg in cases:
        err = one_error(obj)
        assert (err.field, err.message) == (field, msg)
    reqs, errs = parse(batch("ok", CHAT, {"messages": MSGS, "stream": False, "stream_options": None,
                                          "max_tokens": 5, "max_completion_tokens": 3}),
                       batch("one", "/v1/completions", {"prompt": ["a"], "stream": None}),
                       {"prompt": "x", "stream": False})
    assert errs == [] and [(r.id, r.payload, r.params.max_tokens) for r in reqs] == [
        ("ok", MSGS, 3), ("one", "a", 256), ("2", "x", 256)]


def test_iter_requests_streams_one_line_at_a_time():
    def lines():
        yield json.dumps({"id": "a", "prompt": "x"})
        yield ""
        yield json.dumps({"id": "a", "prompt": "y"})
        yield "[1]"
        for i in itertools.count():  # never ends: iter_requests must not read ahead
            yield json.dumps({"prompt": f"p{i}"})

    it = iter_requests(lines(), DEFAULTS)
    (n1, r1, e1), (n3, r3, e3), (n4, r4, e4), (n5, r5, e5) = itertools.islice(it, 4)
    assert (n1, r1.id, r1.payload, e1) == (1, "a", "x", [])
    assert (n3, r3, [(e.line, e.id, e.field, e.message) for e in e3]) == (
        3, None, [(3, "a", "id", "duplicate id 'a' (first on line 1)")])
    assert (n4, r4, [str(e) for e in e4]) == (4, None, ["line 4: must be a JSON object"])
    assert (n5, r5.id, r5.payload, e5) == (5, "4", "p0", [])


def test_parse_requests_reads_lines_like_parse_lines(tmp_path):
    text = ('\ufeff{"prompt": "a"}\r\n\n{"prompt": "b", "max_tokens": -1}\n{"prompt": "c"\n'
            '{"id": "z", "messages": [{"role": "user", "content": [{"type": "text", "text": "1"}, '
            '{"type": "text", "text": "2"}]}]}')  # no newline at the end
    p = tmp_path / "r.jsonl"
    p.write_text(text, encoding="utf-8")
    from_file = parse_requests(p, DEFAULTS)
    from_lines = parse_lines(text.split("\n"), DEFAULTS)
    assert from_file == from_lines
    reqs, errs = from_file
    assert [(r.id, r.line, r.payload) for r in reqs] == [
        ("0", 1, "a"), ("z", 5, [{"role": "user", "content": "1\n2"}])]
    assert [str(e) for e in errs] == [
        "line 3 (id '2'): field 'max_tokens': must be an integer >= 0 (0: score the prompt only), got -1",
        "line 4: invalid JSON: Expecting ',' delimiter at column 15"]


def test_json_that_cannot_be_built_is_an_invalid_line():
    """A line nested too deeply for json.loads, or with an integer of more than 4300 digits, is an
    invalid line like any other (not an exception that ends the job)."""
    from tpengine.frontend.requests import parse_lines

    deep = "[" * 100_000 + "]" * 100_000
    huge = '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"
    requests, errors = parse_lines([deep, huge, '{"prompt": "ok"}'])
    assert [r.payload for r in requests] == ["ok"]
    assert [(e.line, e.field, e.message) for e in errors] == [
        (1, None, "invalid JSON: nested too deeply"),
        (2, None, "invalid JSON: Exceeds the limit (4300 digits) for integer string conversion: value has 5000 "
                  "digits; use sys.set_int_max_str_digits() to increase the limit")]
