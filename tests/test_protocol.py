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
        ("bogus", "unknown field; valid: id, prompt, messages, prompt_token_ids, logprobs, stream, max_tokens, "
                  "temperature, top_p, top_k, min_p, seed, stop, ignore_eos, n, presence_penalty, frequency_penalty, "
                  "repetition_penalty, min_tokens, logit_bias, stop_token_ids, include_stop_str_in_output, "
                  "skip_special_tokens, prompt_logprobs, response_format, structured_outputs, guided_json, "
                  "guided_regex, guided_choice, guided_grammar, add_generation_prompt, continue_final_message, "
                  "chat_template_kwargs")]
    assert errors_of(ChatMessage, {"role": "user", "content": "a", "x": 1}) == [
        ("x", "unknown field; valid: role, content, name, tool_calls, tool_call_id, reasoning_content, reasoning")]
    valid = ", ".join(ChatCompletionRequest.valid_fields())
    assert valid.startswith("messages, logprobs, top_logprobs, echo, max_completion_tokens, model, user, stream")
    assert valid.endswith("add_generation_prompt, continue_final_message, chat_template_kwargs, tools, tool_choice, "
                          "parallel_tool_calls")
    assert "prompt" not in ChatCompletionRequest.valid_fields() and "echo" in valid
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "prompt": "x"}) == [
        ("prompt", f"unknown field; valid: {valid}")]


def test_every_problem_of_a_line_at_once_cross_field_included():
    assert errors_of(SimpleRequest, {"max_tokens": -1, "temperature": "hot", "stream": True}) == [
        ("max_tokens", "must be an integer >= 0 (0: score the prompt only), got -1"),
        ("temperature", 'must be a number >= 0, got "hot"'),
        ("prompt", "exactly one of prompt, messages, prompt_token_ids is required"),
        ("stream", f"{STREAM_ERROR}, got true"),
    ]
    assert errors_of(SimpleRequest, {"prompt": "a", "prompt_token_ids": [1]}) == [
        (None, "exactly one of prompt, messages, prompt_token_ids is required, got prompt, prompt_token_ids")]


def test_strict_json_types():
    assert errors_of(SimpleRequest, {"prompt": "x", "max_tokens": "5"}) == [
        ("max_tokens", 'must be an integer >= 0 (0: score the prompt only), got "5"')]
    assert errors_of(SimpleRequest, {"prompt": "x", "max_tokens": 5.0}) == [
        ("max_tokens", "must be an integer >= 0 (0: score the prompt only), got 5.0")]
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
    ({"echo": 0}, "echo", "not supported by tpengine; only false, got 0"),
    ({"best_of": True}, "best_of", "not supported by tpengine; only 1, got true"),
    ({"best_of": 2}, "best_of", "not supported by tpengine; only 1, got 2"),
])
def test_neutral_values_checked_by_type_and_value(body, field, msg):
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, **body}) == [(field, msg)]


def test_neutral_values_accepted():
    neutral = {"response_format": {"type": "text"}, "echo": False, "best_of": 1, "suffix": None}
    ChatCompletionRequest.model_validate({"messages": MSGS, **neutral})
    nulls = dict.fromkeys(neutral)
    ChatCompletionRequest.model_validate({"messages": MSGS, **nulls})
    assert errors_of(CompletionRequest, {"prompt": "x", "suffix": "!"}) == [
        ("suffix", 'not supported by tpengine; only null, got "!"')]


@pytest.mark.parametrize("body, field, msg", [
    ({"n": 0}, "n", "must be an integer >= 1, got 0"),
    ({"n": True}, "n", "must be an integer >= 1, got true"),
    ({"n": 2.0}, "n", "must be an integer >= 1, got 2.0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "must be a number in [-2, 2], got 2.5"),
    ({"frequency_penalty": False}, "frequency_penalty", "must be a number in [-2, 2], got false"),
    ({"repetition_penalty": 0}, "repetition_penalty", "must be a number > 0, got 0"),
    ({"min_tokens": -1}, "min_tokens", "must be an integer >= 0, got -1"),
    ({"logit_bias": []}, "logit_bias", 'must be an object of token id -> number in [-100, 100] (e.g. {"123": -100}), '
                                       'got []'),
    ({"logit_bias": {"5": "x"}}, "logit_bias",
     'must be an object of token id -> number in [-100, 100] (e.g. {"123": -100}), got {"5": "x"}'),
    ({"logit_bias": {"a": 1}}, "logit_bias",
     'must have token-id keys (decimal integer strings such as "123"), got key "a"'),
    ({"logit_bias": {"-1": 1}}, "logit_bias",
     'must have token-id keys (decimal integer strings such as "123"), got key "-1"'),
    ({"logit_bias": {"5": 101}}, "logit_bias", "must have values in [-100, 100], got 101.0 for token 5"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", "must be a list of integer token ids >= 0, got [1, -2]"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "must be true or false, got 1"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", 'must be true or false, got "no"'),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "must be an integer in [0, 20], got 21"),
    ({"seed": -(2**63) - 1}, "seed", "must be an integer in [-2**63, 2**64), got -9223372036854775809"),
    ({"seed": 2**64}, "seed", "must be an integer in [-2**63, 2**64), got 18446744073709551616"),
    ({"logprobs": 0}, "logprobs", "must be true or false, got 0"),  # chat logprobs is a bool
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be an integer in [0, 20], got 21"),
    ({"top_logprobs": 2}, "top_logprobs", 'needs "logprobs": true, got "logprobs": null'),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", 'needs "logprobs": true, got "logprobs": false'),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "must be <= max_tokens (8), got 9"),
    ({"min_tokens": 9, "max_tokens": 20, "max_completion_tokens": 8}, "min_tokens",
     "must be <= max_completion_tokens (8), got 9"),
])
def test_sampling_fields_checked(body, field, msg):
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, **body}) == [(field, msg)]


def test_sampling_fields_become_sampling_params_kwargs():
    simple = SimpleRequest.model_validate({
        "prompt": "x", "n": 3, "presence_penalty": -0.5, "frequency_penalty": 1, "repetition_penalty": 1.3,
        "min_tokens": 2, "max_tokens": 4, "logit_bias": {"5": -100, "17": 2.5}, "stop_token_ids": [7, 9],
        "include_stop_str_in_output": True, "skip_special_tokens": False, "logprobs": 5, "prompt_logprobs": 0,
        "seed": -(2**63)})
    assert simple.sampling_kwargs() == {
        "max_tokens": 4, "seed": -(2**63), "n": 3, "presence_penalty": -0.5, "frequency_penalty": 1.0,
        "repetition_penalty": 1.3, "min_tokens": 2, "include_stop_str_in_output": True,
        "skip_special_tokens": False, "prompt_logprobs": 0, "stop_token_ids": (7, 9),
        "logit_bias": {5: -100.0, 17: 2.5}, "logprobs": 5}
    assert errors_of(SimpleRequest, {"prompt": "x", "logprobs": True}) == [
        ("logprobs", "must be an integer in [0, 20], got true")]
    assert errors_of(SimpleRequest, {"prompt": "x", "min_tokens": 3, "max_tokens": 2}) == [
        ("min_tokens", "must be <= max_tokens (2), got 3")]
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, "logprobs": True, "top_logprobs": 3, "n": 2,
                                                 "top_k": 5, "min_p": 0.1, "ignore_eos": True, "seed": 2**64 - 1})
    assert chat.sampling_kwargs() == {"top_k": 5, "min_p": 0.1, "seed": 2**64 - 1, "ignore_eos": True, "n": 2,
                                      "logprobs": 3}
    assert ChatCompletionRequest.model_validate({"messages": MSGS, "logprobs": True}).sampling_kwargs() == {
        "logprobs": 0}
    assert ChatCompletionRequest.model_validate({"messages": MSGS, "logprobs": False}).sampling_kwargs() == {}
    comp = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2, "prompt_logprobs": 1})
    assert comp.sampling_kwargs() == {"prompt_logprobs": 1, "logprobs": 2}
    assert errors_of(CompletionRequest, {"prompt": "x", "logprobs": True}) == [
        ("logprobs", "must be an integer in [0, 20], got true")]
    assert errors_of(CompletionRequest, {"prompt": "x", "top_logprobs": 1})[0][1].startswith("unknown field")


ASSISTANT_LAST = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]


def test_chat_template_options():
    r = SimpleRequest.model_validate({"messages": MSGS})
    assert r.template_options() == {"add_generation_prompt": True, "continue_final_message": False,
                                     "chat_template_kwargs": {}}
    r = ChatCompletionRequest.model_validate({"messages": ASSISTANT_LAST, "continue_final_message": True,
                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert r.template_options() == {"add_generation_prompt": False, "continue_final_message": True,
                                    "chat_template_kwargs": {"enable_thinking": False}}
    r = SimpleRequest.model_validate({"messages": MSGS, "add_generation_prompt": False})
    assert r.template_options()["add_generation_prompt"] is False
    both = {"messages": ASSISTANT_LAST, "continue_final_message": True, "add_generation_prompt": True}
    msg = ("cannot be true together with add_generation_prompt true (continue the final message, or open a new "
           "assistant turn: set add_generation_prompt false)")
    assert errors_of(SimpleRequest, both) == [("continue_final_message", msg)]
    assert errors_of(ChatCompletionRequest, both) == [("continue_final_message", msg)]
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "continue_final_message": True}) == [
        ("continue_final_message", 'needs the last message to be the "assistant" message to continue, got role "user"')]
    only = 'applies only to a "messages" prompt (the chat template), not to "prompt"; leave it out'
    assert errors_of(SimpleRequest, {"prompt": "x", "add_generation_prompt": False, "chat_template_kwargs": {}}) == [
        ("add_generation_prompt", only), ("chat_template_kwargs", only)]
    assert errors_of(SimpleRequest, {"prompt_token_ids": [1], "continue_final_message": False}) == [
        ("continue_final_message",
         'applies only to a "messages" prompt (the chat template), not to "prompt_token_ids"; leave it out')]
    assert errors_of(SimpleRequest, {"messages": MSGS, "chat_template_kwargs": []}) == [
        ("chat_template_kwargs", "must be an object, got []")]
    assert errors_of(CompletionRequest, {"prompt": "x", "add_generation_prompt": True})[0][1].startswith(
        "unknown field")
    reserved = {"messages": MSGS, "chat_template_kwargs": {"add_generation_prompt": False, "messages": [], "x": 1}}
    assert errors_of(ChatCompletionRequest, reserved) == [
        ("chat_template_kwargs.add_generation_prompt",
         "is set by tpengine itself, not a template variable; use the top-level 'add_generation_prompt' field"),
        ("chat_template_kwargs.messages", "is set by tpengine itself, not a template variable")]


def test_max_tokens_and_max_completion_tokens_both_validated():
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "max_tokens": -5, "max_completion_tokens": 3}) == [
        ("max_tokens", "must be an integer >= 0 (0: score the prompt only), got -5")]
    assert errors_of(ChatCompletionRequest, {"messages": MSGS, "max_tokens": 3, "max_completion_tokens": -1}) == [
        ("max_completion_tokens", "must be an integer >= 0 (0: score the prompt only), got -1")]
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


def test_one_prompt_a_simple_line_and_four_forms_in_a_completions_body():
    assert errors_of(SimpleRequest, {"prompt": ["a", "b"]}) == [
        ("prompt", "a batch line holds one prompt (send one line per prompt, so that each gets its own record, id "
                   "and --resume entry), got a list of 2 prompts")]
    assert CompletionRequest.model_validate({"prompt": ["a"]}).prompt_payload() == ("prompt", "a")
    assert CompletionRequest.model_validate({"prompt": [3, 4]}).prompt_payload() == ("token_ids", [3, 4])
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt_payloads() == [("prompt", "a"),
                                                                                         ("prompt", "b")]
    assert CompletionRequest.model_validate({"prompt": [[3], [4, 5]]}).prompt_payloads() == [
        ("token_ids", [3]), ("token_ids", [4, 5])]
    assert errors_of(CompletionRequest, {"prompt": [[3], []]}) == [
        ("prompt", "must hold non-empty lists of token ids, got [] at index 1")]
    assert errors_of(CompletionRequest, {"prompt": ["a", 3]}) == [
        ("prompt", "must be a non-empty string, a list of non-empty strings, a list of integer token ids >= 0, or "
                   'a list of such lists, got ["a", 3]')]
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
    assert schema["properties"]["max_tokens"]["anyOf"][0] == {"minimum": 0, "type": "integer"}


def test_record_models():
    assert SimpleErrorRecord.model_validate({"id": "a", "error": {"message": "m"}}).model_dump(exclude_none=True) == {
        "id": "a", "error": {"message": "m"}}
    rec = BatchOutputLine(id="batch_req_1", custom_id="c", error=BatchError(code="invalid_request", message="m"))
    assert rec.model_dump() == {"id": "batch_req_1", "custom_id": "c", "response": None,
                                "error": {"code": "invalid_request", "message": "m", "param": None, "line": None}}
    with pytest.raises(ValidationError):
        BatchOutputLine(id="x", custom_id="c", extra=1)


def test_lenient_mode_drops_unknown_fields_at_any_depth_and_names_them():
    """The server's mode (vLLM's): unknown fields are dropped and named; a known field with a bad
    value is still an error; without the context the same body is refused."""
    from tpengine.protocol.base import IGNORE_UNKNOWN

    body = {"messages": [{"role": "user", "content": "hi", "refusal": None},
                         {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}],
            "service_tier": "auto", "reasoning_effort": "low", "max_tokens": 3}
    found: set = set()
    req = ChatCompletionRequest.model_validate(body, context={IGNORE_UNKNOWN: found})
    assert req.max_tokens == 3 and req.messages[0].to_template() == {"role": "user", "content": "hi"}
    assert found == {("ChatCompletionRequest", "service_tier"), ("ChatCompletionRequest", "reasoning_effort"),
                     ("ChatMessage", "refusal"), ("TextContentPart", "cache_control")}
    assert sorted(f for f, _ in errors_of(ChatCompletionRequest, body)) == [
        "messages[0].refusal", "messages[1].content[0].cache_control", "reasoning_effort", "service_tier"]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**body, "top_k": "ten"}, context={IGNORE_UNKNOWN: set()})
    assert field_errors(e.value) == [("top_k", 'must be an integer >= -1 (0 or -1: disabled), got "ten"')]


def test_an_assistants_earlier_thought_reaches_the_template():
    """vLLM's ``reasoning_content`` / ``reasoning`` on an assistant message of the history: the template
    sees it under both names (Qwen3's template puts it back between the think tags); on another role it
    is refused by name."""
    for field in ("reasoning_content", "reasoning"):
        m = ChatMessage.model_validate({"role": "assistant", "content": "4", field: "2 + 2"})
        assert m.to_template() == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2",
                                   "reasoning": "2 + 2"}
        assert errors_of(ChatMessage, {"role": "user", "content": "a", field: "x"}) == [
            (field, 'belongs to an "assistant" message, got role "user"')]
    assert "reasoning" not in ChatMessage.model_validate({"role": "assistant", "content": "4"}).to_template()
