"""Structured outputs and tool calling through the server (issue 37), with the official ``openai``
client on real ranks (tp=2): ``chat.completions.parse(response_format=PydanticModel)``; a tool round
trip (call -> ``tool`` message -> answer), streamed and not, on SmolLM2 with the Hermes tools template
(``--chat-template``) and on a tiny random Qwen3 the same way; ``auto`` calls read by the ``hermes``
parser from an output forced by a regex (so the model's text is known), a malformed call coming back
as content; a bad schema, an unknown tool and a json_schema format without its schema are 400s naming the
field, and the server serves on ("auto" without a parser: ``test_structured.py``)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model
from launch import REPO
from serving import Server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

TEMPLATE = str(REPO / "examples" / "tool_chat_template_hermes.jinja")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _regex(text: str) -> str:
    """A regex matching exactly ``text`` (xgrammar's and llguidance's syntax)."""
    return "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in text).replace("\n", "\\n")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("tools-smol"), extra=(
        "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    s.model = s.client.models.list().data[0].id
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools-qwen3")
    model = make_tiny_model(root, "qwen3", seed=5, vocab_size=49152, max_position_embeddings=2048, head_dim=16)
    s = Server(root, extra=("--model", str(model), "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                            "--tool-call-parser", "hermes"))
    s.model = s.client.models.list().data[0].id
    yield s
    s.stop()


def _stream(client, **kw) -> tuple[str, list, str | None]:
    """(content, tool calls, finish reason) of a streamed chat completion."""
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        calls += d.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def _check_call(name: str, arguments: str) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_sdk_parse_with_a_pydantic_model(smol):
    class City(pydantic.BaseModel):
        name: str
        country: str
        kind: Literal["capital", "other"]

    r = smol.client.chat.completions.parse(model=smol.model, messages=[
        {"role": "user", "content": "Tell me about Paris as JSON."}], response_format=City, temperature=0,
        max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)
    content, _, reason = _stream(smol.client, model=smol.model, messages=[
        {"role": "user", "content": "Tell me about Paris as JSON."}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}})
    assert reason == "stop" and City.model_validate_json(content) == r.choices[0].message.parsed


# SmolLM2 calls because tool_choice "required" makes it; the random Qwen3 calls because a regex forces
# its text to a Hermes call, which the "auto" parser then reads
@pytest.mark.parametrize("server, call", [("smol", {"tool_choice": "required"}),
                                          ("qwen3", {"extra_body": {"guided_regex": _regex(CALL)}})])
def test_tool_round_trip_streamed_and_not(server, call, request):
    s = request.getfixturevalue(server)
    kw = {"model": s.model, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    r = s.client.chat.completions.create(messages=ASK, **call, **kw)
    m, reason = r.choices[0].message, r.choices[0].finish_reason
    assert reason == "tool_calls" and m.content is None and m.tool_calls
    for c in m.tool_calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        _check_call(c.function.name, c.function.arguments)
    content, calls, sreason = _stream(s.client, messages=ASK, **call, **kw)
    assert sreason == "tool_calls" and content == ""
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(m.tool_calls)]
    history = ASK + [m.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 degrees C and sunny"} for c in m.tool_calls]
    final = s.client.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    content, calls, sreason = _stream(s.client, messages=history, tool_choice="none", **kw)
    assert (content, calls, sreason) == (final.choices[0].message.content, [], final.choices[0].finish_reason)
    if server == "qwen3":
        return
    named = s.client.chat.completions.create(messages=ASK, tool_choice={"type": "function", "function": {
        "name": "add"}}, **kw)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and named.choices[0].finish_reason == "tool_calls"
    _check_call("add", call.function.arguments)


def test_auto_calls_are_parsed_and_a_malformed_one_is_content(smol):
    kw = {"model": smol.model, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    forced = {"guided_regex": _regex("Let me check.\n" + CALL)}
    r = smol.client.chat.completions.create(extra_body=forced, **kw)
    m = r.choices[0].message
    assert (m.content, r.choices[0].finish_reason) == ("Let me check.\n", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    content, calls, reason = _stream(smol.client, extra_body=forced, **kw)
    assert (content, reason) == ("Let me check.\n", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    bad = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    r = smol.client.chat.completions.create(extra_body={"guided_regex": _regex(bad)}, **kw)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        bad, None, "stop")
    assert _stream(smol.client, extra_body={"guided_regex": _regex(bad)}, **kw) == (bad, [], "stop")


def test_errors_name_the_field_and_the_server_serves_on(smol, qwen3):
    cases = [
        (smol, {"messages": ASK, "extra_body": {"guided_json": {"type": "bogus"}}}, "guided_json",
         'cannot compile the JSON schema: xgrammar: Unsupported type "bogus"; guidance: Invalid type: bogus'),
        (smol, {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name",
         'tool_choice.function.name: names no tool of this request: got "nope", the tools are "get_weather", "add"'),
        (qwen3, {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema",
         "response_format.json_schema.schema: is required: the JSON schema the output must follow"),
    ]
    for s, kw, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model=s.model, max_tokens=4, **kw)
        assert (e.value.body["param"], e.value.body["message"]) == (param, message)
    for s in (smol, qwen3):
        r = s.client.chat.completions.create(model=s.model, messages=ASK, max_tokens=2)
        assert r.choices[0].finish_reason == "length"


def test_the_batch_job_gives_the_servers_calls_and_errors(smol, tmp_path):
    """OpenAI Batch chat lines with a schema, required and named tool choices: the same message as
    the server's; a bad schema is that line's error record; "auto" (the batch job has no parser)
    is refused naming the field."""
    from launch import cli
    from serving import SETTINGS

    from tpengine.frontend.requests import BATCH_AUTO_TOOLS

    bodies = {"schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": TOOLS[0][
                  "function"]["parameters"]}}},
              "required": {"tools": TOOLS, "tool_choice": "required"},
              "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
              "bad": {"guided_json": {"type": "bogus"}}}
    lines = [{"custom_id": k, "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": ASK, "temperature": 0, "max_tokens": 60, **b}} for k, b in bodies.items()]
    lines.append({"custom_id": "auto", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": ASK, "tools": TOOLS}})
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cli(["--prompts", prompts, "--out", out, "--skip-invalid", "--chat-template", TEMPLATE, *SETTINGS], tp=2)
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for k in ("schema", "required", "named"):
        want = smol.client.chat.completions.create(model=smol.model, messages=ASK, temperature=0, max_tokens=60,
                                                   **bodies[k]).choices[0]
        got = recs[k]["response"]["body"]["choices"][0]
        assert (got["finish_reason"], got["message"]["content"]) == (want.finish_reason, want.message.content), k
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["message"].get("tool_calls", [])] \
            == [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []], k
    assert recs["required"]["response"]["body"]["choices"][0]["finish_reason"] == "tool_calls"
    assert recs["bad"]["error"]["message"] == ('cannot compile the JSON schema: xgrammar: Unsupported type "bogus"; '
                                               "guidance: Invalid type: bogus")
    assert recs["auto"]["error"]["param"] == "body.tool_choice"
    assert recs["auto"]["error"]["message"] == f"body.tool_choice: {BATCH_AUTO_TOOLS}"
