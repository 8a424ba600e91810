"""Every constraint kept or refused, and counters that add up (issue 54, items 3-5), at tp=2.

* Tool choice for any function schema: ``required`` and named choices for a function with no
  parameters, an empty schema, ``additionalProperties``, nested objects through ``$defs``, ``enum``;
  each call's arguments validate (``jsonschema``); history calls whose ``arguments`` is JSON text, an
  object, ``""`` or missing render as vLLM renders them (``{}`` for empty).
* JSON-schema keywords through the batch job with ``--structured-outputs-backend xgrammar`` (a keyword
  it drops is the line's error record naming it) and the server ("auto": guidance keeps ``multipleOf``
  on a number; ``not`` is a 400 naming it from both libraries).
* The batch job's summary against its records (n > 1, speculation, an error record) and the
  server's ``/metrics`` deltas against the responses (n > 1, an aborted stream, a refused request).

The batch job runs a tiny random model with SmolLM2's tokenizer (its calls are random but every one
keeps its schema); the server is the session's SmolLM2 (``smollm2_server``). The keyword table in
process: ``test_structured_keywords.py``.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import SMOLLM2_DIR
from launch import REPO, cli

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

TEMPLATE = str(REPO / "examples" / "tool_chat_template_hermes.jinja")
ADDRESS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                            "zip": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["city", "zip"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "now"}},  # no parameters
    {"type": "function", "function": {"name": "ping", "parameters": {}}},  # an empty schema
    {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["id"], "additionalProperties": {"type": "boolean"}, "propertyNames": {"pattern": "^[a-z]{1,2}$"},
        "maxProperties": 2}}},
    {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}, "mode": {"enum": ["air", "sea"]}},
        "required": ["to", "mode"], "additionalProperties": False, "$defs": {"Address": ADDRESS}}}},
]
EMPTY = {"type": "object", "properties": {}}
ASK = [{"role": "user", "content": "Do it."}]


def _schema(name: str) -> dict:
    return next(t["function"].get("parameters") or EMPTY for t in TOOLS if t["function"]["name"] == name)


def _check_calls(calls: list[dict]) -> None:
    assert calls
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        assert isinstance(args, dict), c
        jsonschema.Draft202012Validator(_schema(c["function"]["name"])).validate(args)


def _history(arguments) -> list[dict]:
    function = {"name": "tag"} if arguments is ... else {"name": "tag", "arguments": arguments}
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                        "function": function}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def test_history_arguments_render_as_vllm_renders_them():
    """JSON text is decoded, an object kept, ``""`` / missing / ``null`` / ``"null"`` are ``{}``; the
    Hermes template writes them the same."""
    from transformers import AutoTokenizer

    from tpengine.protocol import ChatCompletionRequest

    def rendered(arguments) -> tuple[object, str]:
        body = ChatCompletionRequest.model_validate({"messages": _history(arguments), "tools": TOOLS[2:3]})
        _, messages = body.prompt_payload()
        args = messages[1]["tool_calls"][0]["function"]["arguments"]
        text = tok.apply_chat_template(messages, tools=body.template_options()["tools"], chat_template=template,
                                       tokenize=False, add_generation_prompt=True)
        return args, text

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    template = open(TEMPLATE).read()
    as_text, as_object = rendered('{"id": 3}'), rendered({"id": 3})
    assert as_text == as_object and as_text[0] == {"id": 3}
    assert '"arguments": {"id": 3}' in as_text[1]
    empties = [rendered(a) for a in ("", ..., None, "null", {}, "{}")]
    assert [a for a, _ in empties] == [{}] * 6 and len({t for _, t in empties}) == 1
    assert '"arguments": {}' in empties[0][1]
    assert rendered("not json")[0] == "not json"  # kept as the text it is


def test_required_defs_move_to_the_root_and_a_clash_is_refused():
    from tpengine.frontend.tools import required_schema, tool_use
    from tpengine.protocol import ChatCompletionRequest
    from tpengine.protocol.errors import field_errors

    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    _, constraint = tool_use(body, None, False)
    assert constraint.json == required_schema(body.tools)
    assert constraint.json["$defs"] == {"Address": ADDRESS}
    params = [a["properties"]["parameters"] for a in constraint.json["items"]["anyOf"]]
    assert params[:2] == [EMPTY, EMPTY] and "$defs" not in params[3]
    assert TOOLS[3]["function"]["parameters"]["$defs"] == {"Address": ADDRESS}  # the request's own is untouched
    clash = [*TOOLS, {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Address"}}, "$defs": {"Address": {"type": "string"}}}}}]
    with pytest.raises(Exception) as e:
        ChatCompletionRequest.model_validate({"messages": ASK, "tools": clash, "tool_choice": "required"})
    assert field_errors(e.value) == [("tools[4].function.parameters.$defs.Address",
                                      "Tool definition 'Address' has multiple schemas, which is not supported")]


def _line(cid: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": ASK, "max_tokens": 96, "temperature": 0, **body}}


@pytest.fixture(scope="module")
def no_space() -> dict[str, int]:
    """``logit_bias`` banning SmolLM2's whitespace-only tokens: JSON may hold free whitespace (as in
    vLLM), and a random model would spend its tokens on it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    return {str(t): -100 for t in range(len(tok)) if not tok.decode([t]).strip()}


def test_the_batch_job_keeps_every_tool_schema_and_keyword_and_its_summary_adds_up(tiny, tmp_path, no_space):
    """One job at tp=2 (``--structured-outputs-backend xgrammar``, ngram speculation): named and
    required choices over every tool schema, greedy and seeded; history variants; a keyword xgrammar
    drops (the line's error record names it) and one it keeps; n = 2; an invalid line (an error
    record). The summary's tokens are the records' usage, and its tok/s their sum over the wall time."""
    lines = [_line(f"named-{t['function']['name']}", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": t["function"]["name"]}}}) for t in TOOLS]
    lines += [_line("required", {"tools": TOOLS, "tool_choice": "required"}),
              _line("required-seeded", {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 5,
                                        "parallel_tool_calls": False})]
    lines += [_line(f"history-{k}", {"messages": _history(a), "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
              for k, a in (("text", '{"id": 3}'), ("object", {"id": 3}), ("empty", ""), ("missing", ...),
                           ("empty-text", "{}"))]
    lines += [_line("unique", {"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": {
                  "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}),
              _line("bounded", {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
                  "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
                  "required": ["n"], "additionalProperties": False}}}}),
              _line("n2", {"n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 12}),
              _line("plain", {"max_tokens": 24})]
    for x in lines:
        x["body"]["logit_bias"] = no_space
    prompts, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"custom_id": "bad", "method": "GET"}\n')
    cli(["--prompts", prompts, "--out", out, "--summary-json", summary, "--skip-invalid", "--model", tiny,
         "--chat-template", TEMPLATE, "--structured-outputs-backend", "xgrammar", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}',
         "--max-model-len", "512", "--kv-cache-gb", "0.05"], tp=2)
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for t in TOOLS:
        choice = recs[f"named-{t['function']['name']}"]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [t["function"]["name"]]
        _check_calls(choice["message"]["tool_calls"])
    for k in ("required", "required-seeded"):
        choice = recs[k]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        _check_calls(choice["message"]["tool_calls"])
    assert len(recs["required-seeded"]["response"]["body"]["choices"][0]["message"]["tool_calls"]) == 1
    usage = {k: recs[f"history-{k}"]["response"]["body"]["usage"]["prompt_tokens"]
             for k in ("text", "object", "empty", "missing", "empty-text")}
    assert usage["text"] == usage["object"] and usage["empty"] == usage["missing"] == usage["empty-text"]
    assert usage["text"] == usage["empty"] + 4  # '{"id": 3}' against '{}'
    assert recs["unique"]["error"]["message"] == ("cannot compile the JSON schema: xgrammar does not enforce "
                                                  "uniqueItems (at #)")
    bounded = recs["bounded"]["response"]["body"]["choices"][0]
    assert bounded["finish_reason"] == "stop" and 3 <= json.loads(bounded["message"]["content"])["n"] <= 7
    assert len(recs["n2"]["response"]["body"]["choices"]) == 2
    assert "error" in recs["bad"]

    s = json.loads(summary.read_text())
    ok = [r["response"]["body"]["usage"] for r in recs.values() if r.get("response")]
    assert (s["requests_ok"], s["requests_error"]) == (len(ok), 2)
    assert s["prompt_tokens"] == sum(u["prompt_tokens"] for u in ok)
    assert s["output_tokens"] == sum(u["completion_tokens"] for u in ok)
    n2 = recs["n2"]["response"]["body"]
    assert n2["usage"]["completion_tokens"] == 24  # both samples' 12
    assert s["output_tok_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
    assert s["spec_decode"]["num_draft_tokens"] >= s["spec_decode"]["num_accepted_tokens"]


def test_the_server_keeps_or_refuses_keywords_and_tool_schemas(smollm2_server):
    """"auto" at tp=2: ``multipleOf`` on a number goes to guidance and is kept; ``not`` is a 400 naming it
    from both libraries; a named choice of a function without parameters answers ``{}``; ``required``
    over every tool schema gives valid calls."""
    import openai

    s = smollm2_server
    model = s.client.models.list().data[0].id
    schema = {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 10}
    r = s.client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A number."}],
                                         max_tokens=12, temperature=0, extra_body={"guided_json": schema})
    value = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop" and value * 2 == int(value * 2) and 0 <= value <= 10
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body={
            "guided_json": {"type": "integer", "not": {"const": 3}}})
    assert (e.value.body["param"], e.value.body["message"]) == (
        "guided_json", 'cannot compile the JSON schema: xgrammar does not enforce not (at #); '
                       'guidance: Unimplemented keys: ["not"]')
    r = s.client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "now"}})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == ("now", "{}", "tool_calls")
    r = s.client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                         tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls([c.model_dump() for c in r.choices[0].message.tool_calls])


def test_server_counters_add_up(smollm2_server):
    """``/metrics`` deltas at tp=2 against the responses: n = 2 counts both samples' tokens and two
    successes; a refused request counts nothing; an aborted stream is no success."""
    import httpx2
    import openai

    s = smollm2_server
    model = s.client.models.list().data[0].id
    before, success_before = s.metrics(), _success(s)
    r = s.client.chat.completions.create(model=model, messages=ASK, n=2, max_tokens=6, temperature=1.0, seed=3)
    one = s.client.completions.create(model=model, prompt="The sea is", max_tokens=5, temperature=0)
    with pytest.raises(openai.BadRequestError):
        s.client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body={"guided_regex": "a("})
    mid = s.metrics()
    got = {k: mid.get(k, 0.0) - before.get(k, 0.0) for k in mid}
    assert got["tpengine:prompt_tokens_total"] == r.usage.prompt_tokens + one.usage.prompt_tokens
    assert got["tpengine:generation_tokens_total"] == r.usage.completion_tokens + one.usage.completion_tokens == 17
    success = _success(s)
    assert sum(success.values()) - sum(success_before.values()) == 3  # two samples and one
    with httpx2.stream("POST", s.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "stream": True, "temperature": 0}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # the first token came: hang up
    deadline = time.monotonic() + 30
    while s.metrics().get("tpengine:num_requests_running", 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _success(s) == success  # the aborted stream is no success


def _success(server) -> dict[str, float]:
    """``request_success_total`` by finish reason."""
    import re
    import urllib.request

    text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tpengine:request_success_total\{finished_reason="(\w+)",model_name="[^"]*"\} ([0-9.e+-]+)$', text, re.M)}


def test_counters_count_every_sample_and_no_abort_or_failure_as_a_success():
    """In process, exact: a request of n = 2 (one sample "stop", one "length"), an aborted one and a
    failed one through the run summary and ``/metrics``."""
    from tpengine.engine.outputs import CompletionOutput, EngineOutput
    from tpengine.engine.stats import EngineStats
    from tpengine.frontend.progress import ProgressReporter
    from tpengine.server.metrics import ServerMetrics

    outs = [EngineOutput("n2", [1, 2, 3], [CompletionOutput(0, token_ids=[4, 5], finish_reason="stop"),
                                           CompletionOutput(1, token_ids=[6, 7, 8], finish_reason="length")]),
            EngineOutput("gone", [1, 2], [CompletionOutput(0, token_ids=[9], finish_reason="abort")]),
            EngineOutput("bad", [1], error="no")]
    progress = ProgressReporter(total=3, enabled=False)
    for o in outs:
        progress.on_output(o)
    s = progress.summary()
    assert (s["requests_ok"], s["requests_error"], s["prompt_tokens"], s["output_tokens"]) == (2, 1, 5, 6)
    m = ServerMetrics("m")
    m.observe_step(EngineStats(1, 1, 0, 5, 6, 0, 5, 8, 0, 0), outs)
    text = m.render().decode()
    assert 'tpengine:prompt_tokens_total{model_name="m"} 5.0' in text
    assert 'tpengine:generation_tokens_total{model_name="m"} 6.0' in text
    success = [line for line in text.splitlines() if line.startswith("tpengine:request_success_total")]
    assert success == ['tpengine:request_success_total{finished_reason="stop",model_name="m"} 1.0',
                       'tpengine:request_success_total{finished_reason="length",model_name="m"} 1.0']
