"""Reasoning parsers (issues 37, 54): vLLM's ``deepseek_r1`` and ``qwen3`` rules, and the one decision of
where a thought ends, which the chat response's ``reasoning_content`` / ``content`` split and the
engine's grammar share.

A tiny Llama built to be a state machine (:func:`chain_model`): its layers add nothing, so the next
token depends on the current token alone, and its LM head maps each token of a chain to the next one:
``\\n -> <think> -> " Think" -> " hard" -> "</" -> "think" -> ">" -> " done" -> </think> -> "yes" -> EOS``.
Its thought holds ``</think>`` spelled by three smaller tokens before the real ``</think>`` token; its
template opens the thought in the prompt (DeepSeek R1's and Qwen3.5's), closes it with
``enable_thinking: false`` (Qwen3's) or leaves it to the model (``think_in_output``: the older
Qwen3's). In-process: the parsers on every stream prefix, the start-up checks, the engine's grammar
after the thought; at tp=2 one server (``qwen3``) and one batch job (``deepseek_r1``) on the chain model
and the start-up refusals as exit 2.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model
from launch import CLI_EXTRA, cli, command, free_port, run
from serving import Server

from tpengine.engine.detokenizer import IncrementalDetokenizer
from tpengine.entrypoints.model_checks import check_flags_against_model
from tpengine.errors import UserError
from tpengine.frontend.output import chat_message
from tpengine.frontend.reasoning import Qwen3ReasoningParser, ReasoningParser, thought_tags
from tpengine.frontend.tool_parsers import HermesToolParser
from tpengine.frontend.tools import ToolUse

pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
            "{% elif not (think_in_output is defined and think_in_output) %}<think>{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Is it?"}]
THOUGHT = " Think hard</think> done"  # the thought's text: a "</think>" of three small tokens inside it


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer with <think> and </think> as single tokens, and :data:`TEMPLATE`."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    t.add_tokens(["<think>", "</think>"], special_tokens=False)
    t.chat_template = TEMPLATE
    return t


def chain(tok) -> list[int]:
    """The chain's token ids, each one followed by the next (the last by EOS)."""
    ids = [tok.encode("\n")[0], tok.convert_tokens_to_ids("<think>")] + tok.encode(" Think hard")
    ids += tok.encode("</", add_special_tokens=False) + [17400, 46] + tok.encode(" done")
    return ids + [tok.convert_tokens_to_ids("</think>"), tok.encode("yes")[0], tok.eos_token_id]


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory, tok):
    """The state-machine model of the module's docstring, with :func:`tok` saved beside it."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path_factory.mktemp("thinker"), "llama", vocab_size=len(tok),
                             max_position_embeddings=512, name="thinker")
    tok.save_pretrained(folder)
    path = folder / "model.safetensors"
    w = load_file(path)
    ids = chain(tok)
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name].zero_()  # each layer adds nothing: the hidden state is the current token's embedding
    w["lm_head.weight"].zero_()
    for i, t in enumerate(ids[:-1]):
        w["model.embed_tokens.weight"][t] = torch.nn.functional.one_hot(torch.tensor(i), 64).float()
        w["lm_head.weight"][ids[i + 1]] = 10.0 * torch.nn.functional.one_hot(torch.tensor(i), 64).float()
    save_file(w, path, metadata={"format": "pt"})
    return folder


def prompt_ids(tok, messages=ASK, **kwargs) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)


def texts(tok, prompt: list[int], out: list[int]) -> list[str]:
    """The engine's text after each output token (its detokenizer, no stop strings)."""
    d = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    seen = []
    for t in out:
        d.append(t)
        seen.append(d.text)
    return seen


def test_the_chain_and_the_rules_of_both_parsers(tok):
    ids = chain(tok)
    tags = thought_tags("deepseek_r1", tok)
    assert (tags.start_id, tags.end_id) == (49152, 49153) and tok.decode(ids[2:8]) == THOUGHT
    opened, closed = prompt_ids(tok), prompt_ids(tok, enable_thinking=False)
    plain = prompt_ids(tok, think_in_output=True)
    assert (opened[-1], closed[-1], plain[-1]) == (tags.start_id, tags.end_id, ids[0])
    # an earlier turn's thought in the history: the last tag of the prompt decides, not the first
    history = ASK + [{"role": "assistant", "content": "<think>old</think>no"}, {"role": "user", "content": "Sure?"}]
    assert tags.end_id in prompt_ids(tok, history)
    for parser in (ReasoningParser, Qwen3ReasoningParser):
        assert parser.starts_thinking(tags, opened) and parser.starts_thinking(tags, prompt_ids(tok, history))
        assert not parser.starts_thinking(tags, closed)
        assert parser.starts_thinking(tags, plain, {"enable_thinking": True})
    # no tag in the prompt: R1 starts in its thought whatever the kwargs; Qwen3 not when thinking is off
    assert ReasoningParser.starts_thinking(tags, plain, {"enable_thinking": False})
    assert not Qwen3ReasoningParser.starts_thinking(tags, plain, {"enable_thinking": False})
    cases = [  # (prompt, output ids, reasoning, content)
        (opened, ids[2:], THOUGHT, "yes"),  # the output begins inside the thought
        (plain, ids[1:], THOUGHT, "yes"),  # the model writes <think> itself: dropped
        (opened, ids[2:6], " Think hard</think", None),  # cut off by max_tokens: all of it is the thought
        (opened, ids[2:9], THOUGHT, None),  # it ends right after </think>
        (closed, ids[9:], None, "yes"),  # the prompt closed the thought
    ]
    for prompt, out, thought, content in cases:
        p = ReasoningParser.for_request(tags, tok, prompt)
        text = texts(tok, prompt, out)[-1]
        assert p.split(text, out) == (thought, content), (prompt[-1], out)
        # the engine's grammar starts where the split puts the content
        end = tags.thought_end(out, p.thinking)
        assert (end is None) == (out == ids[2:6])  # only the cut-off thought never ends
        if end is not None:
            assert (texts(tok, prompt, out[end:])[-1] if out[end:] else "") == (content or "")
    qwen_off = Qwen3ReasoningParser.for_request(tags, tok, plain, {"enable_thinking": False})
    assert (qwen_off.thinking, qwen_off.split("yes", ids[9:10])) == (False, (None, "yes"))


def test_streamed_prefixes_add_up_whatever_the_chunks(tok):
    """Every prefix of tokens, its text lagging by up to two tokens (the detokenizer's hold-back): the
    reasoning and content seen so far only grow, and end as the final split; the "</think>" spelled
    over three tokens never ends the thought, the one token does."""
    tags, prompt, out = thought_tags("qwen3", tok), prompt_ids(tok), chain(tok)[2:]
    seen = texts(tok, prompt, out)
    final = Qwen3ReasoningParser.for_request(tags, tok, prompt).split(seen[-1], out)
    assert final == (THOUGHT, "yes")
    for lag in (0, 1, 2):
        p = Qwen3ReasoningParser.for_request(tags, tok, prompt)
        thought, content = "", ""
        for n in range(1, len(out) + 1):
            text = seen[max(n - 1 - lag, 0)] if n > lag else ""
            t, c = p.split(text, out[:n], finished=False)
            assert (t or "").startswith(thought) and (c or "").startswith(content), (lag, n)
            assert c is None or n >= 7  # content only once the </think> token is in
            thought, content = t or "", c or ""
        assert p.split(seen[-1], out) == final


def test_chat_message_with_reasoning_and_tools(tok):
    tags = thought_tags("deepseek_r1", tok)
    out = [tok.convert_tokens_to_ids("<think>")] + tok.encode("weather") + [tags.end_id] + tok.encode(
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    text = tok.decode(out)
    p = ReasoningParser.for_request(tags, tok, tok.encode("Q"))
    msg, reason = chat_message(text, "stop", ToolUse("auto", parser=HermesToolParser()), p, out)
    assert (msg.reasoning_content, msg.content, reason) == ("weather", None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("now", "{}")]
    assert "reasoning_content" not in chat_message("hi", "stop", None, None)[0].model_dump()


def test_start_up_checks_name_the_flag_the_marker_and_the_tokenizer(chain_model):
    smol = str(SMOLLM2_DIR)
    hermes = (SMOLLM2_DIR.parent.parent / "examples" / "tool_chat_template_hermes.jinja")
    cases = [
        (dict(reasoning_parser="qwen3"), f"--reasoning-parser qwen3: the tokenizer of {smol} has no '<think>' "
         "token (it spells it as 3 tokens ['<', 'think', '>']); the qwen3 parser reads <think> and </think> as "
         "one token each, as vLLM's does; serve a model whose tokenizer has them, or leave --reasoning-parser out"),
        (dict(tool_parser="hermes"), f"--tool-call-parser hermes: the chat template of {smol} renders the same "
         "with and without tools (it drops them), so the model never sees its tools; give --chat-template with a "
         "template that renders them (e.g. examples/tool_chat_template_hermes.jinja)"),
        (dict(tool_parser="hermes", chat_template="{{ messages[0].content }}{% for t in tools or [] %}{{ t }}"
              "{% endfor %}", chat_template_flag="t.jinja"), "--tool-call-parser hermes: the chat template never "
         "shows the model the marker '<tool_call>' that the hermes parser reads calls by; choose the parser of "
         "this template's tool-call format, or a --chat-template that asks for it"),
        (dict(chat_template="{% for m in messages if m.role != 'system' %}{{ m.content }}{% endfor %}",
              chat_template_flag="t.jinja"), "--chat-template t.jinja: the chat template drops the content of a "
         "'system' message, which the server sends (role 'system'); give --chat-template with a template that "
         "renders it"),
        (dict(tool_parser="hermes", chat_template=hermes.read_text().replace("<tool_response>\\n' + message.content",
                                                                             "<tool_response>\\n'"),
              chat_template_flag="t.jinja"), "--chat-template t.jinja: the chat template drops the content of a "
         "'tool' message (a tool's result), which the server sends (role 'tool'); give --chat-template with a "
         "template that renders it"),
    ]
    for kw, message in cases:
        with pytest.raises(UserError) as e:
            check_flags_against_model(smol, **kw)
        assert str(e.value) == message
    check_flags_against_model(smol, tool_parser="hermes", chat_template=hermes.read_text())
    check_flags_against_model(chain_model, reasoning_parser="qwen3")  # both tags are single tokens


def test_the_grammar_starts_after_the_thought_only_when_the_front_end_says_so(chain_model, tok):
    """In process (tp=1): ``thinking`` set, the choice starts after the </think> token (the three-token
    spelling before it is free thought); unset (completions, the LLM API), constrained from the first
    token although the engine has a reasoning parser."""
    from tpengine import SamplingParams, StructuredOutputsParams
    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine

    choice = StructuredOutputsParams(choice=("yes", "no"))
    prompt, ids = prompt_ids(tok), chain(tok)
    engine = LLMEngine(EngineConfig(model=str(chain_model), dtype="float32", max_model_len=128, num_kv_blocks=64,
                                    reasoning_parser="deepseek_r1"))
    try:
        outs = engine.generate([("free", prompt, SamplingParams(temperature=0, max_tokens=16)),
                                ("thinking", prompt, SamplingParams(temperature=0, max_tokens=16,
                                                                    structured_outputs=choice, thinking=True)),
                                ("plain", prompt, SamplingParams(temperature=0, max_tokens=16,
                                                                 structured_outputs=choice))])
    finally:
        engine.shutdown()
    free, thinking, plain = sorted(outs, key=lambda o: ["free", "thinking", "plain"].index(o.request_id))
    assert free.token_ids == ids[2:]
    assert thinking.token_ids == ids[2:] and thinking.finish_reason == "stop"
    assert plain.text in ("yes", "no") and tok.convert_tokens_to_ids("</think>") not in plain.token_ids


def _stream(client, **kw) -> tuple[str, str, str | None]:
    thought, content, reason = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            thought += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return thought, content, reason


def test_server_and_batch_job_at_tp2(chain_model, tmp_path):
    """One ``qwen3`` server and one ``deepseek_r1`` batch job at tp=2 on the chain model: the thought
    (with its three-token "</think>") is ``reasoning_content``, the content after it keeps the request's
    choice, regex or schema, streamed and not; thinking off per request; a thought cut off by
    ``max_tokens``; a completion with the same prompt is constrained from its first token."""
    s = Server(tmp_path, extra=("--model", str(chain_model), "--max-model-len", "256", "--reasoning-parser",
                                "qwen3"))
    try:
        kw = {"model": "thinker", "messages": ASK, "temperature": 0, "max_tokens": 16}
        cases = [({}, THOUGHT, "yes", "stop"),
                 ({"extra_body": {"guided_choice": ["no", "yes"]}}, THOUGHT, "yes", "stop"),
                 ({"extra_body": {"guided_regex": "[0-9]{2}"}}, THOUGHT, re.compile("[0-9]{2}"), "stop"),
                 ({"max_tokens": 4}, " Think hard</think", None, "length"),
                 ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}, "guided_choice": ["yes"]}},
                  None, "yes", "stop"),
                 ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False, "think_in_output": True},
                                  "guided_choice": ["no", "yes"]}}, None, re.compile("yes|no"), "stop")]
        for extra, thought, content, reason in cases:
            r = s.client.chat.completions.create(**{**kw, **extra})
            m = r.choices[0].message
            assert getattr(m, "reasoning_content", None) == thought, extra
            if isinstance(content, re.Pattern):
                assert content.fullmatch(m.content), (extra, m.content)
            else:
                assert m.content == content, extra
            assert reason is None or r.choices[0].finish_reason == reason, extra
            assert _stream(s.client, **{**kw, **extra}) == (thought or "", m.content or "", r.choices[0].finish_reason)
        # a JSON schema and a named tool call after the thought: the content is what they allow
        schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["yes", "no"]}}}
        r = s.client.chat.completions.create(**kw, response_format=schema)
        assert (r.choices[0].message.reasoning_content, json.loads(r.choices[0].message.content)) == (THOUGHT, "yes")
        tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
        r = s.client.chat.completions.create(**kw, tools=[tool], tool_choice={"type": "function",
                                                                              "function": {"name": "ping"}})
        m = r.choices[0].message
        assert m.reasoning_content == THOUGHT and [(c.function.name, json.loads(c.function.arguments))
                                                   for c in m.tool_calls] == [("ping", {})]
        done = s.client.completions.create(model="thinker", prompt=prompt_ids_of(chain_model), temperature=0,
                                           max_tokens=8, extra_body={"guided_choice": ["no", "yes"]})
        assert done.choices[0].text in ("yes", "no")
    finally:
        s.stop()
    lines = [{"custom_id": "choice", "method": "POST", "url": "/v1/chat/completions", "body": {
                 **{k: v for k, v in kw.items() if k != "model"}, "guided_choice": ["no", "yes"]}},
             {"custom_id": "cut", "method": "POST", "url": "/v1/chat/completions", "body": {
                 "messages": ASK, "temperature": 0, "max_tokens": 4}},
             {"id": "simple", "messages": ASK, "temperature": 0, "max_tokens": 16}]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cli(["--prompts", prompts, "--out", out, "--model", chain_model, "--max-model-len", "256", "--dtype", "float32",
         "--kv-cache-gb", "0.05", "--reasoning-parser", "deepseek_r1"], tp=2)
    recs = {r.get("custom_id", r.get("id")): r for r in map(json.loads, out.read_text().splitlines())}
    msg = recs["choice"]["response"]["body"]["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (THOUGHT, "yes")
    cut = recs["cut"]["response"]["body"]["choices"][0]
    assert (cut["message"]["reasoning_content"], cut["message"]["content"], cut["finish_reason"]) == (
        " Think hard</think", None, "length")
    assert recs["simple"]["text"] == THOUGHT + "</think>yes"  # a simple line: the text as generated


def prompt_ids_of(folder) -> list[int]:
    from transformers import AutoTokenizer

    return prompt_ids(AutoTokenizer.from_pretrained(folder))


def test_start_up_refusals_exit_2_before_the_weights_load(tmp_path):
    """At tp=1 the exit code is the rank's, 2; at tp=2 the launcher's is torchrun's (non-zero) after rank 0's
    one line."""
    smol = str(SMOLLM2_DIR)
    line = f"error: --reasoning-parser deepseek_r1: the tokenizer of {smol} has no '<think>' token"
    r = run(command("tpengine.serve", ["--model", smol, "--port", free_port(), "--reasoning-parser", "deepseek_r1"]),
            env=CLI_EXTRA, check=False)
    assert r.returncode == 2 and r.stderr.startswith(line) and "Traceback" not in r.stderr, r.stderr[-3000:]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for tp in (1, 2):
        r = cli(["--prompts", prompts, "--model", smol, "--reasoning-parser", "deepseek_r1"], tp=tp, check=False)
        assert (r.returncode == 2) if tp == 1 else r.returncode != 0, r.stderr[-3000:]
        assert any(x.startswith(line) for x in r.stderr.splitlines()) and "loading" not in r.stderr, r.stderr[-3000:]
