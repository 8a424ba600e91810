"""Reasoning (issue 37): the ``qwen3`` parser's split of ``<think>...</think>`` into
``reasoning_content`` and content, streamed prefixes adding up to the final split; the chat message
with reasoning and tool calls; and, in the engine, a structured output that starts only once the
thought has ended (a tiny Qwen3 whose tokenizer has ``<think>`` / ``</think>`` tokens, the end
token forced by ``logit_bias``)."""

from __future__ import annotations

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model

from tpengine.frontend.output import chat_message
from tpengine.frontend.reasoning import ReasoningParser
from tpengine.frontend.tool_parsers import HermesToolParser
from tpengine.frontend.tools import ToolUse

pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

TEXT = '<think>\nThe user wants JSON.\n</think>\n\n{"a": 1}'


def test_split_and_streamed_prefixes_add_up():
    p = ReasoningParser()
    assert p.split(TEXT) == ("The user wants JSON.\n", '{"a": 1}')
    assert p.split("no thought here") == (None, "no thought here")
    assert p.split("<think>\nstill thinking") == ("still thinking", None)  # truncated thought
    thought, content = "", ""
    for n in range(1, len(TEXT) + 1):  # every prefix, as a stream sees them
        t, c = p.split(TEXT[:n], finished=n == len(TEXT))
        assert (t or "").startswith(thought) and (c or "").startswith(content), TEXT[:n]
        thought, content = t or "", c or ""
    assert (thought, content) == p.split(TEXT)
    assert p.split("<thi", finished=False) == (None, None) and p.split("<think>ab</thi", finished=False) == ("ab", None)


def test_chat_message_with_reasoning_and_tools():
    msg, reason = chat_message(TEXT, "stop", None, ReasoningParser())
    assert (msg.reasoning_content, msg.content, reason) == ("The user wants JSON.\n", '{"a": 1}', "stop")
    assert "reasoning_content" not in chat_message("hi", "stop", None, None)[0].model_dump()
    call = '<think>weather</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    msg, reason = chat_message(call, "stop", ToolUse("auto", parser=HermesToolParser()), ReasoningParser())
    assert (msg.reasoning_content, msg.content, reason) == ("weather", None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("now", "{}")]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer (SmolLM2's) has <think> and </think> as single tokens."""
    from transformers import AutoTokenizer

    model = make_tiny_model(tmp_path_factory.mktemp("thinker"), "qwen3", seed=2, vocab_size=49160, head_dim=16)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    tok.save_pretrained(model)
    return model, tok


def test_the_grammar_starts_after_the_thought(thinker):
    from tpengine import LLM, SamplingParams, StructuredOutputsParams

    model, tok = thinker
    end = tok.convert_tokens_to_ids("</think>")
    choice = StructuredOutputsParams(choice=("yes", "no"))
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice, logit_bias={end: 100.0})
    prompt = tok.encode("Answer:")
    for parser, want_first in (("qwen3", end), (None, None)):
        llm = LLM(str(model), dtype="float32", max_model_len=128, reasoning_parser=parser)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        ids = out.outputs[0].token_ids
        if parser:  # the bias forces </think> while thinking; then only the choices are allowed
            assert ids[0] == want_first and tok.decode(ids[1:], skip_special_tokens=True) in ("yes", "no")
        else:  # constrained from the start: the biased </think> is masked
            assert end not in ids and out.outputs[0].text in ("yes", "no")
        assert out.outputs[0].finish_reason == "stop"
        # a prompt that already closed the thought (Qwen3 without thinking) is constrained from the start
        (closed,) = llm.generate([{"prompt_token_ids": prompt + [end]}], params)
        assert closed.outputs[0].text in ("yes", "no") and end not in closed.outputs[0].token_ids
        llm.shutdown()
