"""Chat-template options reach tokenizer.apply_chat_template (frontend.requests.to_token_ids):
continue_final_message on SmolLM2's template continues the trailing assistant message,
add_generation_prompt false opens no new turn, chat_template_kwargs are template variables."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from transformers import AutoTokenizer

from tpengine.frontend.requests import parse_lines, to_token_ids

HISTORY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REPO / "models" / "smollm2-135m-instruct")


def one(obj):
    reqs, errs = parse_lines([json.dumps(obj)], {})
    assert errs == [], [str(e) for e in errs]
    return reqs[0]


def test_continue_final_message_continues_the_assistant_message(tok):
    ids = to_token_ids(one({"messages": HISTORY, "continue_final_message": True}), tok)
    content = tok("Hello there", add_special_tokens=False)["input_ids"]
    assert content == [19556, 665]
    assert ids[-2:] == content  # ends with the assistant content: no <|im_end|>, no new turn
    end = tok.convert_tokens_to_ids("<|im_end|>")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(end) == 2 and ids.count(start) == 3  # system and user closed, the assistant's open
    assert tok.decode(ids).endswith("<|im_start|>assistant\nHello there")
    closed = to_token_ids(one({"messages": HISTORY, "add_generation_prompt": False}), tok)
    assert closed[:len(ids)] == ids and closed[len(ids):] == [end, tok("\n", add_special_tokens=False)["input_ids"][0]]
    opened = to_token_ids(one({"messages": HISTORY}), tok)  # default: a new assistant turn after it
    assert opened[:len(closed)] == closed and tok.decode(opened[len(closed):]) == "<|im_start|>assistant\n"


def test_chat_template_kwargs_are_template_variables(tok):
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                         "{% if add_generation_prompt %}>>{% endif %}")
    try:
        msgs = [{"role": "user", "content": "Q"}]
        off = one({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}})
        assert tok.decode(to_token_ids(off, tok)) == "Q<think></think>>>"
        assert tok.decode(to_token_ids(one({"messages": msgs}), tok)) == "Q>>"
        plain = one({"messages": msgs, "add_generation_prompt": False,
                     "chat_template_kwargs": {"enable_thinking": True}})
        assert tok.decode(to_token_ids(plain, tok)) == "Q"
    finally:
        tok.chat_template = saved
