"""The protocol layer (tpengine.protocol): request models, their error messages and field paths,
vLLM's semantics (neutral values by type and value, stream, max_tokens / max_completion_tokens,
text parts, one prompt a line), and the output record models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tpengine.protocol import (
    STREAM_ERROR,
    BatchError,
    BatchOutputLine,
    BatchRequestLine,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SimpleErrorRecord,
    SimpleRequest,
    field_errors,
    field_path,
)

MSGS = [{"role": "user", "content": "hi"}]


def errors_of(model, obj):
    with pytest.raises(ValidationError) as e:
        model.model_validate(obj)
    return field_errors(e.value)


def line(body, url="/v1/chat/completions"):
    return {"custom_id": "c", "method": "POST", "url": url, "body": body}


def test_field_path():
    assert field_path(("body", "messages", 0, "role")) == "body.messages[0].role"
    assert field_path(("messages", 2, "content", 1, "type")) == "messages[2].content[1].type"
    assert field_path(("max_tokens",)) == "max_tokens"
    assert field_path(()) is None


def test_unknown_field_names_the_valid_ones_own_first():
    assert errors_of(SimpleRequest, {"prompt": "x", "bogus": 1}) == [
        ("bogus", "unknown field; valid: id, prompt, messages, prompt_token_ids, stream, max_tokens, temperature, "
                  "top_p, top_k, min_p, seed, stop, ignore_eos")]
    assert errors_of(ChatMessage, {"role": "user", "content": "a", "x": 1}) == [
        ("x", "unknown field; valid: role, content, name")]
    valid = ", ".join(ChatCompletionRequest.valid_fields())
    assert valid.startswith("messages, logprobs, max_completion_tokens, n, model, user, stream")
    assert "prompt" not in ChatCompletionRequest.valid_fields() and "echo" in valid
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "prompt": "x"}) == [
        ("prompt", f"unknown field; valid: {valid}")]


def test_every_problem_of_a_line_at_once_cross_field_included():
    assert errors_of(SimpleRequest, {"max_tokens": 0, "temperature": "hot", "stream": True}) == [
        ("max_tokens", "must be an integer >= 1, got 0"),
        ("temperature", 'must be a number >= 0, got "hot"'),
        ("prompt", "exactly one of prompt, messages, prompt_token_ids is required"),
        ("stream", f"{STREAM_ERROR}, got true"),
    ]
    assert errors_of(SimpleRequest, {"prompt": "a", "prompt_token_ids": [1]}) == [
        (None, "exactly one of prompt, messages, prompt_token_ids is required, got prompt, prompt_token_ids")]


def test_strict_json_types():
    assert errors_of(SimpleRequest, {"prompt": "x", "max_tokens": "5"}) == [
        ("max_tokens", 'must be an integer >= 1, got "5"')]
    assert errors_of(SimpleRequest, {"prompt": "x", "max_tokens": 5.0}) == [
        ("max_tokens", "must be an integer >= 1, got 5.0")]
    assert errors_of(SimpleRequest, {"prompt": "x", "top_p": True}) == [
        ("top_p", "must be a number in (0, 1], got true")]
    assert errors_of(SimpleRequest, {"prompt": "x", "ignore_eos": 1}) == [
        ("ignore_eos", "must be true or false, got 1")]
    assert errors_of(SimpleRequest, {"id": True, "prompt": "x"}) == [
        ("id", "must be a non-empty string or an integer, got true")]
    assert errors_of(SimpleRequest, {"prompt_token_ids": [1, True]}) == [
        ("prompt_token_ids", "must be a list of token ids (a non-empty list of integer token ids >= 0), got [1, true]")]
    r = SimpleRequest.model_validate({"id": 7, "prompt": "x", "temperature": 1, "top_k": -1, "stop": "s"})
    assert (r.request_id(0), r.temperature, r.sampling_kwargs()) == (
        "7", 1.0, {"temperature": 1.0, "top_k": 0, "stop": ("s",)})


@pytest.mark.parametrize("body, field, msg", [
    ({"logprobs": 0}, "logprobs", "not supported by tpengine; only false, got 0"),  # chat logprobs is a bool
    ({"logprobs": True}, "logprobs", "not supported by tpengine; only false, got true"),
    ({"n": True}, "n", "only n=1 is supported, got true"),  # n must be the integer 1
    ({"n": 1.0}, "n", "only n=1 is supported, got 1.0"),
    ({"n": 2}, "n", "only n=1 is supported, got 2"),
    ({"frequency_penalty": False}, "frequency_penalty", "not supported by tpengine; only 0, got false"),
    ({"presence_penalty": 0.1}, "presence_penalty", "not supported by tpengine; only 0, got 0.1"),
    ({"top_logprobs": False}, "top_logprobs", "not supported by tpengine; only 0, got false"),
    ({"logit_bias": []}, "logit_bias", "not supported by tpengine; only {}, got []"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     'not supported by tpengine; only {"type": "text"}, got {"type": "json_object"}'),
    ({"echo": 0}, "echo", "not supported by tpengine; only false, got 0"),
    ({"best_of": True}, "best_of", "not supported by tpengine; only 1, got true"),
])
def test_neutral_values_checked_by_type_and_value(body, field, msg):
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, **body}) == [(field, msg)]


def test_neutral_values_accepted():
    neutral = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "top_logprobs": 0,
               "logit_bias": {}, "response_format": {"type": "text"}, "echo": False, "best_of": 1, "suffix": None}
    ChatCompletionRequest.model_validate({"messages": MSGS, **neutral})
    nulls = dict.fromkeys(neutral)
    ChatCompletionRequest.model_validate({"messages": MSGS, **nulls})
    assert errors_of(CompletionRequest, {"prompt": "x", "logprobs": 0}) == [
        ("logprobs", "not supported by tpengine; only null, got 0")]  # completions logprobs is an integer
    assert errors_of(CompletionRequest, {"prompt": "x", "suffix": "!"}) == [
        ("suffix", 'not supported by tpengine; only null, got "!"')]


def test_max_tokens_and_max_completion_tokens_both_validated():
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "max_tokens": -5, "max_completion_tokens": 3}) == [
        ("max_tokens", "must be an integer >= 1, got -5")]
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "max_tokens": 3, "max_completion_tokens": 0}) == [
        ("max_completion_tokens", "must be an integer >= 1, got 0")]
    both = ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 5, "max_completion_tokens": 3})
    assert both.sampling_kwargs() == {"max_tokens": 3}
    assert ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 5}).sampling_kwargs() == {
        "max_tokens": 5}
    assert ChatCompletionRequest.model_validate({"messages": MSGS}).sampling_kwargs() == {}


def test_stream_true_refused_in_batch_lines_false_and_null_accepted():
    msg = ("streaming is not supported in a batch job (each request gets one complete record); "
           "use false or omit it, got true")
    assert errors_of(BatchRequestLine, line({"messages": MSGS, "stream": True})) == [("body.stream", msg)]
    assert errors_of(SimpleRequest, {"prompt": "x", "stream": True}) == [("stream", msg)]
    for v in (False, None):
        b = BatchRequestLine.model_validate(line({"messages": MSGS, "stream": v,
                                                  "stream_options": {"include_usage": True}}))
        assert b.format == "openai_chat" and b.body.sampling_kwargs() == {}
        SimpleRequest.model_validate({"prompt": "x", "stream": v})
    # a server's body may stream: the body model itself accepts it
    assert ChatCompletionRequest.model_validate({"messages": MSGS, "stream": True}).stream is True


def test_text_parts_joined_with_newline():
    m = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]})
    assert m.text() == "a\nb" and m.to_template() == {"role": "user", "content": "a\nb"}
    assert ChatMessage.model_validate({"role": "user", "content": "x", "name": "bo"}).to_template() == {
        "role": "user", "content": "x", "name": "bo"}
    assert errors_of(ChatMessage, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "image_url", "text": "u"}]}) == [
        ("content[1].type", 'must be "text" (tpengine serves text only), got "image_url"')]
    assert errors_of(ChatMessage, {"role": "user", "content": 5}) == [
        ("content", "must be a string (or a list of text parts), got 5")]
    assert errors_of(ChatMessage, {"role": "", "content": "x"}) == [("role", 'must be a non-empty string, got ""')]
    assert errors_of(ChatMessage, {}) == [("role", "is required: must be a non-empty string"),
                                          ("content", "is required: must be a string (or a list of text parts)")]
    assert errors_of(ChatMessage, "hi") == [(None, 'must be an object with "role" and "content"')]


def test_one_prompt_a_line():
    assert errors_of(CompletionRequest, {"prompt": ["a", "b"]}) == [
        ("prompt", "a batch line holds one prompt: a list of 2 prompts is not supported (send one line per prompt)")]
    assert CompletionRequest.model_validate({"prompt": ["a"]}).prompt_payload() == ("prompt", "a")
    assert CompletionRequest.model_validate({"prompt": [3, 4]}).prompt_payload() == ("token_ids", [3, 4])
    assert CompletionRequest.model_validate({"prompt": "p"}).prompt_payload() == ("prompt", "p")
    assert errors_of(CompletionRequest, {"prompt": ""}) == [("prompt", "must be non-empty")]
    assert errors_of(CompletionRequest, {}) == [("prompt", "is required")]


def test_batch_line_body_follows_url():
    b = BatchRequestLine.model_validate(line({"prompt": "x", "max_tokens": 2}, "/v1/completions"))
    assert isinstance(b.body, CompletionRequest) and b.format == "openai_completion"
    assert b.body.sampling_kwargs() == {"max_tokens": 2}
    assert errors_of(BatchRequestLine, line({"prompt": "x"})) == [
        ("body.messages", "is required"),
        ("body.prompt", f"unknown field; valid: {', '.join(ChatCompletionRequest.valid_fields())}")]
    assert errors_of(BatchRequestLine, {**line(5, "/v1/embeddings"), "method": "GET"}) == [
        ("method", 'must be "POST", got "GET"'),
        ("url", 'must be one of /v1/chat/completions, /v1/completions, got "/v1/embeddings"'),
        ("body", "must be an object, got 5")]
    assert errors_of(BatchRequestLine, line({"messages": [{"role": "user", "content": [{"type": "text"}]}]})) == [
        ("body.messages[0].content[0].text", "is required")]


def test_long_values_are_cut_in_messages():
    (field, msg), = errors_of(SimpleRequest, {"prompt": "x", "stop": ["a" * 500, 1]})
    assert field == "stop" and len(msg) < 140 and msg.endswith("...")


def test_json_schema_for_a_server():
    schema = ChatCompletionRequest.model_json_schema()
    assert schema["required"] == ["messages"] and schema["additionalProperties"] is False
    assert schema["properties"]["max_tokens"]["anyOf"][0] == {"minimum": 1, "type": "integer"}


def test_record_models():
    assert SimpleErrorRecord.model_validate({"id": "a", "error": {"message": "m"}}).model_dump(exclude_none=True) == {
        "id": "a", "error": {"message": "m"}}
    rec = BatchOutputLine(id="batch_req_1", custom_id="c", error=BatchError(code="invalid_request", message="m"))
    assert rec.model_dump() == {"id": "batch_req_1", "custom_id": "c", "response": None,
                                "error": {"code": "invalid_request", "message": "m", "param": None, "line": None}}
    with pytest.raises(ValidationError):
        BatchOutputLine(id="x", custom_id="c", extra=1)
