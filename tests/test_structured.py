"""Structured outputs and tool calling, in process (issue 37): the constraint's own checks, both
grammar libraries compiling every kind with exact errors and a shared cache, the bitmask letting
through exactly the tokens a constraint allows, the request forms (``response_format``,
``structured_outputs``, ``guided_*``) and their conflicts, and the tool-call parsers and
``tool_choice`` modes on fixed texts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMOLLM2_DIR
from pydantic import ValidationError

from tpengine.frontend.tool_parsers import HermesToolParser, Llama3JsonToolParser, ParsedCall
from tpengine.frontend.tools import AUTO_NEEDS_FLAGS, ToolUse, tool_use
from tpengine.protocol import ChatCompletionRequest, SimpleRequest
from tpengine.protocol.errors import field_errors
from tpengine.structured import StructuredOutputsParams as S

pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")
EOS = 2  # SmolLM2's <|im_end|>
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def manager(request, tok):
    from tpengine.structured import StructuredOutputManager

    m = StructuredOutputManager(tok, 49152, [EOS], backend=request.param)
    yield m
    m.close()


def test_params_need_exactly_one_constraint_of_the_right_type():
    with pytest.raises(ValueError, match=r"^structured_outputs needs exactly one of json, regex, choice, grammar, "
                                         r"json_object, got none$"):
        S()
    with pytest.raises(ValueError, match=r"got regex, choice$"):
        S(regex="a", choice=("a",))
    with pytest.raises(ValueError, match=r"^structured_outputs.json: not a JSON schema: invalid JSON: Expecting "
                                         r"value at column 1$"):
        S(json="oops")
    with pytest.raises(ValueError, match=r"^structured_outputs.choice must be a non-empty list of strings, got \[\]$"):
        S(choice=())
    assert S(json='{"type": "string"}').json == {"type": "string"}
    assert S(json_object=True).kind == "json_object" and S(regex="a", json_object=False).kind == "regex"
    # the schema's property order is kept: it is the order the output writes the keys in
    assert S(json={"b": 1, "a": 2}).spec == '{"b":1,"a":2}'


def _walk(m, text_ids: list[int]) -> bool:
    return all(m.accept(t) for t in text_ids)


@pytest.mark.parametrize("kind, spec, good, bad", [
    ("json", SCHEMA, '{"name": "Bo", "age": 3}', '{"name": 3}'),
    ("regex", r"\d{3}-\d{4}", "555-1234", "55a"),
    ("choice", ("yes", "no"), "no", "maybe"),
    ("json_object", True, '{"x": [1, 2]}', "[1]"),
])
def test_both_libraries_accept_what_the_constraint_allows_and_refuse_the_rest(manager, tok, kind, spec, good, bad):
    grammar = manager.compile(S(**{kind: spec})).result()
    m = grammar.matcher()
    assert _walk(m, tok.encode(good))
    # complete: only the stop token may follow (llguidance ends the matcher on its own once nothing else can)
    assert m.is_terminated or (m.accept(EOS) and m.is_terminated)
    m = grammar.matcher()
    assert not _walk(m, tok.encode(bad))


def test_a_grammar_in_each_librarys_syntax(tok):
    from tpengine.structured import StructuredOutputManager

    m = StructuredOutputManager(tok, 49152, [EOS], backend="auto")
    ebnf = m.compile(S(grammar='root ::= "up" | "down"')).result()  # xgrammar's EBNF
    lark = m.compile(S(grammar='start: "left" | "right"')).result()  # Lark: xgrammar refuses it, guidance takes it
    assert (ebnf.backend, lark.backend) == ("xgrammar", "guidance")
    assert _walk(lark.matcher(), tok.encode("left"))
    m.close()


def test_bad_constraints_name_the_problem_and_failures_are_cached(tok):
    from tpengine.structured import GrammarError, StructuredOutputManager

    m = StructuredOutputManager(tok, 49152, [EOS], backend="auto")
    bad = S(json={"type": "bogus"})
    fut = m.compile(bad)
    with pytest.raises(GrammarError) as e:
        fut.result()
    assert str(e.value) == ('cannot compile the JSON schema: xgrammar: Unsupported type "bogus"; '
                            "guidance: Invalid type: bogus")
    assert m.compile(S(json={"type": "bogus"})) is fut  # cached by the constraint, failures too
    with pytest.raises(GrammarError, match=r"^cannot compile the regex: xgrammar: Regex parsing error at position 3: "
                                           r"The parenthesis is not closed\."):
        m.check(S(regex="a("))
    m.close()
    with pytest.raises(ValueError, match=r"^invalid structured_outputs_backend='outlines': must be one of auto, "
                                         r"xgrammar, guidance$"):
        StructuredOutputManager(tok, 49152, [EOS], backend="outlines")


def test_the_mask_lets_through_exactly_the_allowed_tokens(manager, tok):
    grammar = manager.compile(S(choice=("yes", "no"))).result()
    firsts = {tok.encode("yes")[0], tok.encode("no")[0]}
    mask = manager.fill([grammar.matcher(), None])
    assert mask.shape == (2, 49152 // 32) and mask.dtype == torch.int32
    logits = torch.zeros(2, 49152)
    manager.apply(logits, mask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert firsts <= set(allowed) and len(allowed) < 50  # "y", "ye", "yes", "n", "no" and the like
    for t in allowed:
        text = tok.decode([t])
        assert "yes".startswith(text) or "no".startswith(text), text
    assert torch.isfinite(logits[1]).all()  # a row without a matcher is untouched
    m = grammar.matcher()
    assert _walk(m, tok.encode("no"))
    done = torch.zeros(1, 49152)
    manager.apply(done, manager.fill([m]))
    assert torch.isfinite(done[0]).nonzero().flatten().tolist() == [EOS]  # complete: only the stop token


def errors_of(model, obj) -> list[tuple[str | None, str]]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(obj)
    return field_errors(e.value)


MSGS = [{"role": "user", "content": "hi"}]


def test_every_request_form_gives_one_constraint():
    forms = [({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                          "strict": True}}}, S(json=SCHEMA)),
             ({"response_format": {"type": "json_object"}}, S(json_object=True)),
             ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
              S(regex="a+", disable_any_whitespace=True)),
             ({"guided_json": json.dumps(SCHEMA)}, S(json=SCHEMA)),
             ({"guided_choice": ["a", "b"]}, S(choice=("a", "b"))),
             ({"guided_regex": "x"}, S(regex="x")),
             ({"guided_grammar": 'root ::= "a"'}, S(grammar='root ::= "a"')),
             ({"response_format": {"type": "text"}}, None)]
    for body, want in forms:
        chat = ChatCompletionRequest.model_validate({"messages": MSGS, **body})
        assert chat.sampling_kwargs().get("structured_outputs") == want, body
        simple = SimpleRequest.model_validate({"prompt": "x", **body})
        assert simple.sampling_kwargs().get("structured_outputs") == want, body


def test_request_form_errors_name_the_field():
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "guided_regex": "a", "response_format": {
        "type": "json_object"}}) == [("guided_regex", "only one output constraint may be given, got response_format, "
                                                      "guided_regex")]
    assert errors_of(SimpleRequest, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}) == [
        ("structured_outputs", "needs exactly one of json, regex, choice, grammar, json_object, got regex, choice")]
    assert errors_of(SimpleRequest, {"prompt": "x", "response_format": {"type": "json_schema"}}) == [
        ("response_format.json_schema", 'is required with "type": "json_schema"')]
    assert errors_of(SimpleRequest, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "p"}}}) == [("response_format.json_schema.schema",
                             "is required: the JSON schema the output must follow")]
    assert errors_of(SimpleRequest, {"prompt": "x", "guided_choice": []}) == [
        ("guided_choice", "must be a non-empty list of strings, got []")]
    assert errors_of(SimpleRequest, {"prompt": "x", "structured_outputs": {"json": {}, "whitespace_pattern": " "}}) == [
        ("structured_outputs.whitespace_pattern", 'not supported by tpengine; leave it out, got " "')]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def test_tool_fields_and_history_messages():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}], "tools": TOOLS})
    assert body.tool_mode == "auto"
    _, messages = body.prompt_payload()
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert messages[2] == {"role": "tool", "content": "cold", "tool_call_id": "c1"}
    assert body.template_options()["tools"] == TOOLS
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}) == [
        ("tool_choice.function.name", 'names no tool of this request: got "nope", the tools are "get_weather", "now"')]
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "tool_choice": "required"}) == [
        ("tool_choice", 'needs tools to choose from, got tool_choice "required" and no tools')]
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "tools": TOOLS, "tool_choice": "required",
                                             "guided_regex": "a"}) == [
        ("guided_regex", 'cannot be given with tool_choice "required", which constrains the output itself')]
    assert errors_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": None}]}) == [
        ("messages[0].content", "must be a string (or a list of text parts) (null only in an assistant message "
                                "with tool_calls), got null")]


def test_tool_choice_modes_and_their_constraints():
    def use(extra: dict, parser: str | None = "hermes", auto: bool = True):
        return tool_use(ChatCompletionRequest.model_validate({"messages": MSGS, "tools": TOOLS, **extra}), parser, auto)

    assert use({"tool_choice": "none"}) == (None, None)
    u, c = use({})
    assert u.mode == "auto" and isinstance(u.parser, HermesToolParser) and c is None
    with pytest.raises(ValueError, match=f"^{AUTO_NEEDS_FLAGS}$"):
        use({}, None, False)
    u, c = use({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, None, False)
    assert u == ToolUse("named", name="get_weather") and c == S(json=TOOLS[0]["function"]["parameters"])
    u, c = use({"tool_choice": "required", "parallel_tool_calls": False}, None, False)
    assert u.mode == "required" and c.json["maxItems"] == 1 and c.json["minItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in c.json["items"]["anyOf"]] == [["get_weather"], ["now"]]
    assert u.extract('[{"name": "now", "parameters": {}}]') == (None, [ParsedCall("now", "{}")])
    assert u.extract('[{"name": "now"') == ('[{"name": "now"', [])  # truncated: content
    named = ToolUse("named", name="get_weather")
    assert named.extract('{"city": "Rome"}') == (None, [ParsedCall("get_weather", '{"city": "Rome"}')])


def test_hermes_parser():
    p = HermesToolParser()
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>{"name": "now"}</tool_call>'
    assert p.extract(text) == ("Let me look.\n", [ParsedCall("get_weather", '{"city": "Oslo"}'),
                                                  ParsedCall("now", "{}")])
    assert p.extract('<tool_call>{"name": "now", "arguments": {}}') == (None, [ParsedCall("now", "{}")])  # unclosed
    malformed = 'ok <tool_call>{"name": now}</tool_call>'
    assert p.extract(malformed) == (malformed, [])
    assert p.extract("plain") == ("plain", [])
    assert p.content_end("Hi <tool") == 3 and p.content_end("Hi <tool_call>{") == 3 and p.content_end("Hi") == 2


def test_llama3_json_parser():
    p = Llama3JsonToolParser()
    assert p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (
        None, [ParsedCall("get_weather", '{"city": "Oslo"}')])
    assert p.extract('{"name": "now", "parameters": {}}; {"name": "now", "arguments": {}}') == (
        None, [ParsedCall("now", "{}"), ParsedCall("now", "{}")])
    assert p.extract('{"name": "now", "parameters": {}} and more') == ('{"name": "now", "parameters": {}} and more', [])
    assert p.extract("The weather is fine.") == ("The weather is fine.", [])
    assert p.content_end('  {"na') == 0 and p.content_end("<|py") == 0 and p.content_end("Sure") == 4
