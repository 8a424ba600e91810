"""Flags checked against the model at start-up, before the weights load: ``--reasoning-parser``,
``--tool-call-parser`` and the chat template in effect (``--chat-template`` or the tokenizer's).

Each mistake is one :class:`tpengine.errors.UserError` naming the flag, the marker and the tokenizer
(the entry points turn it into one ``error:`` line and exit 2), as vLLM's parsers refuse to start:

* ``--reasoning-parser``: the tokenizer must have ``<think>`` and ``</think>`` as one token each (the
  form the parser and the engine's grammar match: :func:`tpengine.engine.thoughts.thought_tags`);
* ``--tool-call-parser``: the tokenizer must spell the parser's markers as the parser reads them
  (``hermes``: ``<tool_call>`` / ``</tool_call>`` decode back to themselves), and the chat template
  must render ``tools`` (a conversation renders differently with a tool than without), show the
  model the parser's marker once tools are given (``hermes``: ``<tool_call>``), and render the
  ``tool`` results and assistant ``tool_calls`` the server sends back in a history;
* the chat template must render every ``system``, ``user`` and ``assistant`` message the server
  sends (the Responses API's ``instructions`` and the Messages API's ``system`` become system
  messages). A template that raises for a role is the request's own 400, not a start-up error.
"""

from __future__ import annotations

import os
from typing import Any

from tpengine.errors import UserError

#: Per ``--tool-call-parser``: (the markers its tokenizer must spell, the marker the template must show
#: the model once tools are given).
TOOL_MARKERS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "hermes": (("<tool_call>", "</tool_call>"), "<tool_call>"),
    "llama3_json": ((), None),  # its calls are plain JSON: nothing to spell, no tag to show
}

_PROBE_TOOL = {"type": "function", "function": {
    "name": "tpengine_probe_tool", "description": "tpengine's start-up probe",
    "parameters": {"type": "object", "properties": {"tpengine_probe_arg": {"type": "string"}}}}}


def _render(tokenizer, messages: list[dict[str, Any]], tools: list | None = None) -> str | None:
    """The template's text of ``messages`` (with a generation prompt), or None when it raises."""
    try:
        kw = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    except Exception:  # noqa: BLE001 -- a template that refuses a shape: the request's own 400, not ours
        return None


def _dropped_roles(tokenizer, tools: bool) -> list[tuple[str, str]]:
    """(role, what is missing) for each message kind the template leaves out of the prompt."""
    out = []
    marks = {r: f"tpengine-probe-{r}" for r in ("system", "user", "assistant")}
    chat = [{"role": "system", "content": marks["system"]}, {"role": "user", "content": marks["user"]},
            {"role": "assistant", "content": marks["assistant"]}, {"role": "user", "content": "next"}]
    text = _render(tokenizer, chat)
    if text is not None:
        out += [(r, f"the content of a {r!r} message") for r, m in marks.items() if m not in text]
    if tools:
        call = {"id": "call_tpengine_probe", "type": "function",
                "function": {"name": "tpengine_probe_tool", "arguments": {"tpengine_probe_arg": "x"}}}
        history = [{"role": "user", "content": "call it"},
                   {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "tpengine-probe-tool-result"}]
        text = _render(tokenizer, history, [_PROBE_TOOL])
        if text is not None:
            if "tpengine-probe-tool-result" not in text:
                out.append(("tool", "the content of a 'tool' message (a tool's result)"))
            if text.count("tpengine_probe_tool") < 2:  # once in the tools, once in the call
                out.append(("assistant", "an 'assistant' message's tool_calls"))
    return out


def check_template_and_parsers(tokenizer, where: str, reasoning_parser: str | None = None,
                               tool_parser: str | None = None, template_flag: str | None = None) -> None:
    """Check ``tokenizer`` (its ``chat_template`` the one in effect) against the parser flags.

    Args:
        where: the tokenizer's name in messages (its model folder).
        reasoning_parser, tool_parser: the ``--reasoning-parser`` / ``--tool-call-parser`` values.
        template_flag: ``"--chat-template FILE"`` when the template came from the flag, else None
            (the tokenizer's own); with neither a tool parser nor this, the roles are not checked.

    Raises:
        UserError: one line naming the flag, the marker and the tokenizer.
    """
    from tpengine.engine.thoughts import thought_tags

    thought_tags(reasoning_parser, tokenizer)  # ReasoningTagsMissing (a UserError) names all three
    template = "the chat template" if template_flag else f"the chat template of {where}"
    if tool_parser is not None:
        flag = f"--tool-call-parser {tool_parser}"
        spelled, shown = TOOL_MARKERS[tool_parser]
        for marker in spelled:
            back = tokenizer.decode(tokenizer.encode(marker, add_special_tokens=False))
            if back != marker:
                raise UserError(f"{flag}: the tokenizer of {where} cannot spell the marker {marker!r} (it decodes "
                                f"back as {back!r}), which the {tool_parser} parser reads; choose the parser of this "
                                "model's tool-call format")
        user = [{"role": "user", "content": "hi"}]
        with_tools, without = _render(tokenizer, user, [_PROBE_TOOL]), _render(tokenizer, user)
        if with_tools is not None and with_tools == without:
            raise UserError(f"{flag}: {template} renders the same with and without tools (it drops them), so "
                            "the model never sees its tools; give --chat-template with a template that renders "
                            "them (e.g. examples/tool_chat_template_hermes.jinja)")
        if with_tools is not None and shown is not None and shown not in with_tools:
            raise UserError(f"{flag}: {template} never shows the model the marker {shown!r} that the "
                            f"{tool_parser} parser reads calls by; choose the parser of this template's tool-call "
                            "format, or a --chat-template that asks for it")
    if tool_parser is None and template_flag is None:
        return
    for role, what in _dropped_roles(tokenizer, tool_parser is not None):
        flag = template_flag or f"--tool-call-parser {tool_parser}"
        raise UserError(f"{flag}: {template} drops {what}, which the server sends (role {role!r}); give "
                        "--chat-template with a template that renders it")


def check_flags_against_model(model_dir: str | os.PathLike, reasoning_parser: str | None = None,
                              tool_parser: str | None = None, chat_template: str | None = None,
                              chat_template_flag: str | None = None) -> None:
    """Load the tokenizer of ``model_dir`` (only when a flag asks: no parser and no template is
    nothing to check), put ``chat_template`` in (``--chat-template``'s text; ``chat_template_flag``
    its value, for messages) and run :func:`check_template_and_parsers`.

    Raises:
        UserError: a parser flag or template the model cannot honour (one line naming them), or a
            tokenizer that cannot be loaded.
    """
    if reasoning_parser is None and tool_parser is None and chat_template is None:
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 -- a folder without a tokenizer: the user's to fix
        raise UserError(f"cannot load the tokenizer of {model_dir}: {type(e).__name__}: {e}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    flag = None if chat_template is None else f"--chat-template {chat_template_flag or '(text)'}"
    check_template_and_parsers(tokenizer, str(model_dir), reasoning_parser, tool_parser, flag)
