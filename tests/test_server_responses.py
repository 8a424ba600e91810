"""``/v1/responses`` (OpenAI's Responses API) and ``/v1/messages`` (Anthropic's Messages API) on the
session's tp=2 SmolLM2 server, each driven by its real client: the ``openai`` SDK's
``responses.create`` / ``stream`` / ``parse`` / ``retrieve``, the openai Agents SDK's default model
(``OpenAIResponsesModel``) running a tool loop, the ``anthropic`` SDK's ``messages.create`` /
``stream`` / ``count_tokens``. Both APIs run on the chat path, so greedy answers equal the chat
completions answers of the same conversation token for token; tool calls are forced with a named
tool choice over an enum (the tiny model then writes them reliably). Then the translation pieces
without a server: the event sequences of thoughts, text and calls, the store's bound, the items."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city now", "parameters": WEATHER}
ATOOL = {"name": "get_weather", "description": "The weather in a city now", "input_schema": WEATHER}
ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_server):
    smollm2_server.model = smollm2_server.client.models.list().data[0].id
    return smollm2_server


@pytest.fixture(scope="module")
def claude(server):
    import httpx2

    http = anthropic.DefaultHttpxClient(limits=httpx2.Limits(keepalive_expiry=2.0))
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120, http_client=http)


def _chat(server, messages, max_tokens):
    """The greedy chat completion of ``messages``: (content, usage)."""
    out = server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0)
    return out.choices[0].message.content, out.usage


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- /v1/responses ----------------------------------------------------------------------------
def test_responses_equal_chat_and_continue_a_stored_response(server):
    c = server.client
    r1 = c.responses.create(model=server.model, instructions="You are brief.", input="Say hi.", max_output_tokens=8,
                            **GREEDY)
    turn1 = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hi."}]
    text, usage = _chat(server, turn1, 8)
    assert (r1.status, r1.incomplete_details.reason, r1.output_text) == ("incomplete", "max_output_tokens", text)
    assert [(i.type, i.role, i.status, [p.type for p in i.content]) for i in r1.output] == [
        ("message", "assistant", "completed", ["output_text"])]
    assert (r1.usage.input_tokens, r1.usage.output_tokens, r1.usage.total_tokens) == (
        usage.prompt_tokens, 8, usage.prompt_tokens + 8)
    assert (r1.instructions, r1.max_output_tokens, r1.store, r1.model) == ("You are brief.", 8, True, server.model)
    # previous_response_id: its input and output come first, its instructions do not carry over
    r2 = c.responses.create(model=server.model, input="And in French?", previous_response_id=r1.id,
                            max_output_tokens=6, **GREEDY)
    text2, _ = _chat(server, [turn1[1], {"role": "assistant", "content": text},
                              {"role": "user", "content": "And in French?"}], 6)
    assert (r2.output_text, r2.previous_response_id) == (text2, r1.id)
    assert c.responses.retrieve(r1.id).output_text == text
    # input items: a developer message is a system message; the same answer as the string form
    r3 = c.responses.create(model=server.model, input=[{"role": "developer", "content": "You are brief."},
                                                       {"role": "user", "content": [{"type": "input_text",
                                                                                     "text": "Say hi."}]}],
                            max_output_tokens=8, store=False, **GREEDY)
    assert r3.output_text == text and r3.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r3.id)
    status, err = _post(server, "/v1/responses", {"input": "x", "previous_response_id": r3.id})
    assert (status, err["error"]["param"]) == (404, "previous_response_id")


def test_responses_stream_events_in_order(server):
    with server.client.responses.stream(model=server.model, input="Say hi.", max_output_tokens=4, **GREEDY) as s:
        events = list(s)
        final = s.get_final_response()
    text, _ = _chat(server, [{"role": "user", "content": "Say hi."}], 4)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas), "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == text == final.output_text and len(deltas) >= 2
    assert (events[0].response.status, final.status, final.usage.output_tokens) == ("in_progress", "incomplete", 4)
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2] if hasattr(e, "item_id")} == {item_id} == {final.output[0].id}


def test_responses_tool_round_trip_streamed_and_not(server):
    c = server.client
    r = c.responses.create(model=server.model, input=ASK, tools=[TOOL], tool_choice={"type": "function",
                                                                                     "name": "get_weather"},
                           max_output_tokens=32, **GREEDY)
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == [("function_call", "get_weather",
                                                                             {"city": "Paris"})]
    assert r.status == "completed" and r.output[0].call_id
    events = list(c.responses.create(model=server.model, input=ASK, tools=[TOOL], stream=True, max_output_tokens=32,
                                     tool_choice={"type": "function", "name": "get_weather"}, **GREEDY))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[4].arguments == r.output[0].arguments == events[-1].response.output[0].arguments
    # the call and its output go back as items; "auto" on a server without a tool-call parser answers in text
    call = r.output[0]
    back = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r2 = c.responses.create(model=server.model, input=back, tools=[TOOL], max_output_tokens=6, **GREEDY)
    text, _ = _chat(server, [{"role": "user", "content": ASK},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": call.call_id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": call.arguments}}]},
                             {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}], 6)
    assert r2.output_text == text


def test_responses_parse_follows_the_schema(server):
    class Answer(pydantic.BaseModel):
        city: Literal["Paris", "London"]

    r = server.client.responses.parse(model=server.model, input=ASK, text_format=Answer, max_output_tokens=32,
                                      **GREEDY)
    assert r.output_parsed == Answer(city="Paris") and r.text.format.type == "json_schema"


def test_agents_sdk_runs_a_tool_loop(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """The weather in a city now."""
        cities.append(city)
        return f"sunny, 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    # a named choice for the first turn (reset after the call); a stop string ends the answer, so the
    # response is "completed" (the SDK refuses an incomplete one)
    settings = agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48,
                                    extra_body={"stop": ["."]})
    agent = agents.Agent(name="weather", instructions="You answer weather questions.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=server.model, openai_client=client),
                         model_settings=settings)
    result = asyncio.run(agents.Runner.run(agent, ASK))
    assert cities == ["Paris"]
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output


def test_responses_bad_input_is_a_400_naming_the_field(server):
    cases = [({"input": [{"role": "bot", "content": "x"}]}, "input[0].role", '"user", "system", "developer"'),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
              "input[0].content[0]", "tpengine serves text only"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
             ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name",
              "is required"),
             ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "(max_output_tokens)"),
             ({"input": []}, "input", "non-empty"), ({"input": "x", "background": True}, "background", "only false"),
             ({"input": "x", "model": "gpt-4o"}, "model", "does not exist")]
    for body, param, words in cases:
        status, err = _post(server, "/v1/responses", body)
        assert (status, err["error"]["param"]) == (404 if param == "model" else 400, param), (body, err)
        assert words in err["error"]["message"], (body, err)


# --- /v1/messages -----------------------------------------------------------------------------
def test_messages_equal_chat_with_stop_sequences_and_count_tokens(server, claude):
    convo = [{"role": "user", "content": "Say hi."}]
    m = claude.messages.create(model=server.model, max_tokens=8, system=[{"type": "text", "text": "You are brief."}],
                               messages=convo, extra_body=GREEDY)
    text, usage = _chat(server, [{"role": "system", "content": "You are brief."}, *convo], 8)
    assert [(b.type, b.text) for b in m.content] == [("text", text)]
    assert (m.stop_reason, m.stop_sequence, m.usage.input_tokens, m.usage.output_tokens) == (
        "max_tokens", None, usage.prompt_tokens, 8)
    assert claude.messages.count_tokens(model=server.model, system="You are brief.", messages=convo
                                        ).input_tokens == usage.prompt_tokens
    stop = next(ch for ch in text if not ch.isalnum() and ch != " ")  # the first punctuation of the answer
    m = claude.messages.create(model=server.model, max_tokens=8, system="You are brief.", messages=convo,
                               stop_sequences=[stop, "zzz"], extra_body=GREEDY)
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (text.split(stop)[0], "stop_sequence", stop)


RAW = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
       "message_stop"}


def test_messages_tool_round_trip_streamed_and_not(server, claude):
    named = {"type": "tool", "name": "get_weather"}
    m = claude.messages.create(model=server.model, max_tokens=32, tools=[ATOOL], tool_choice=named,
                               messages=[{"role": "user", "content": ASK}], extra_body=GREEDY)
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert m.stop_reason == "tool_use"
    with claude.messages.stream(model=server.model, max_tokens=32, tools=[ATOOL], tool_choice=named,
                                messages=[{"role": "user", "content": ASK}], extra_body=GREEDY) as s:
        events = [e for e in s if e.type in RAW]
        final = s.get_final_message()
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert (events[1].content_block.type, events[2].delta.type, events[4].delta.stop_reason) == (
        "tool_use", "input_json_delta", "tool_use")
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]
    # the result goes back; the answer streams as text and equals the chat answer
    convo = [{"role": "user", "content": ASK}, {"role": "assistant", "content": m.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[0].id,
                                           "content": "sunny, 21 C"}]}]
    with claude.messages.stream(model=server.model, max_tokens=6, tools=[ATOOL], tool_choice={"type": "none"},
                                messages=convo, extra_body=GREEDY) as s:
        events = [e for e in s if e.type in RAW]
        final = s.get_final_message()
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert [e.type for e in events] == ["message_start", "content_block_start", *["content_block_delta"] * len(deltas),
                                        "content_block_stop", "message_delta", "message_stop"]
    text, usage = _chat(server, [{"role": "user", "content": ASK},
                                 {"role": "assistant", "content": None, "tool_calls": [{
                                     "id": m.content[0].id, "type": "function", "function": {
                                         "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                                 {"role": "tool", "tool_call_id": m.content[0].id, "content": "sunny, 21 C"}], 6)
    assert "".join(deltas) == final.content[0].text == text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        "max_tokens", usage.prompt_tokens, 6)


def test_messages_errors_are_anthropics(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:  # "auto" (the default with tools) needs a parser
        claude.messages.create(model=server.model, max_tokens=4, tools=[ATOOL], messages=[{"role": "user",
                                                                                             "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')}}
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus-4", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    cases = [({"messages": [{"role": "user", "content": "x"}]}, "max_tokens: is required"),
             ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 'messages[0].role: must be "user"'),
             ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
              "messages[0].content[0]: type \"image\" is not supported"),
             ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [ATOOL],
               "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name: names no tool"),
             ({"max_tokens": 4000, "messages": [{"role": "user", "content": "x"}]}, "max_tokens: this model's maximum")]
    for body, words in cases:
        status, err = _post(server, "/v1/messages", body)
        assert (status, err["type"], err["error"]["type"]) == (400, "error", "invalid_request_error"), (body, err)
        assert err["error"]["message"].startswith(words), (body, err)


# --- the translation, without a server --------------------------------------------------------
def _chunks(*deltas, finish="stop"):
    out = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    out[-1]["choices"][0]["finish_reason"] = finish
    return out + [{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4,
                                            "prompt_tokens_details": {"cached_tokens": 0}}}]


def _types(events: list[str]) -> list[str]:
    return [json.loads(e.split("data: ", 1)[1])["type"] for e in events]


def test_thoughts_text_and_calls_become_items_and_events():
    from tpengine.server import anthropic_messages as am
    from tpengine.server import responses as rs

    message = {"role": "assistant", "content": "Paris.", "reasoning_content": "think",
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    items = rs.output_items(message)
    assert [(i.type, getattr(i, "call_id", None)) for i in items] == [("reasoning", None), ("message", None),
                                                                      ("function_call", "call_1")]
    assert (items[0].content[0].text, items[1].content[0].text) == ("think", "Paris.")
    assert rs.history_message(items) == {"role": "assistant", "content": "Paris.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert [b.type for b in am.content_blocks(message)] == ["thinking", "text", "tool_use"]
    chunks = _chunks({"role": "assistant", "content": ""}, {"reasoning_content": "thi"}, {"reasoning_content": "nk"},
                     {"content": "Paris."}, {"tool_calls": message["tool_calls"]}, finish="tool_calls")
    w = rs.EventWriter()
    events = [e for c in chunks for e in w.chunk(c)] + w.close()
    assert _types(events) == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [i.model_dump() for i in w.items] == [
        {"id": w.items[0].id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                               "text": "think"}],
         "status": "completed"},
        {"id": w.items[1].id, "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}]},
        {"id": w.items[2].id, "type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"}]
    assert (w.finish, rs.status_of(w.finish), rs.usage_of(w.usage).total_tokens) == ("tool_calls", "completed", 9)
    a = am.EventWriter()
    events = [e for c in chunks for e in a.chunk(c)] + a.close()
    datas = [json.loads(e.split("data: ", 1)[1]) for e in events]
    shapes = [(d["type"], d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type")) for d in datas]
    assert shapes == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None)]
    assert am.stop_of(a.finish, None) == ("tool_use", None) and am.stop_of("stop", "!") == ("stop_sequence", "!")


def test_items_become_chat_messages_and_the_store_is_bounded():
    from tpengine.protocol.anthropic import MessagesRequest
    from tpengine.protocol.responses import ResponsesRequest
    from tpengine.server import anthropic_messages as am
    from tpengine.server import responses as rs

    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "output_text", "text": "Yes"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}], "tools": [TOOL], "max_output_tokens": 9})
    msgs = rs.input_messages(body)
    assert msgs == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    chat = rs.chat_body(body, msgs, auto_tools=False)
    assert (chat["messages"][0], chat["max_completion_tokens"], chat["tool_choice"]) == (
        {"role": "system", "content": "Be brief."}, 9, "none")
    assert rs.chat_body(body, msgs, auto_tools=True)["tool_choice"] == "auto"
    assert [rs.responses_param(p) for p in ("messages[3].content", "max_completion_tokens", "response_format",
                                            "tools[0].function.parameters", "tool_choice.function.name")] == [
        "input", "max_output_tokens", "text.format", "tools[0].parameters", "tool_choice.name"]
    req = MessagesRequest.model_validate({"max_tokens": 5, "system": "S", "tools": [ATOOL], "tool_choice": {
        "type": "any", "disable_parallel_tool_use": True}, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {"type": "tool_use", "id": "t1", "name": "f",
                                                                           "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "3"}]}, {"type": "text", "text": "thanks"}]},
        {"role": "assistant", "content": "Sure"}]})
    chat = am.chat_body(req)
    assert chat["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [{"id": "t1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"}, {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "Sure"}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["continue_final_message"]) == ("required", False,
                                                                                                  True)
    store = rs.ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(rid, rs.Stored({"id": rid}, []))
    assert store.get("a") is not None  # read: now the most recently used
    store.put("c", rs.Stored({"id": "c"}, []))
    assert (store.get("b"), len(store), store.get("a").response, store.get("c").response) == (
        None, 2, {"id": "a"}, {"id": "c"})
