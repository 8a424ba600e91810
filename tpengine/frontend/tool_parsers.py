"""Tool-call parsers: the model's text -> OpenAI ``tool_calls`` (vLLM's ``--tool-call-parser``
names and formats).

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``; text before the first call is the message's content.
* ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole output is one call
  ``{"name": ..., "parameters": {...}}`` (or several joined by ``;``), optionally after
  ``<|python_tag|>``.

A parser reads a whole output (:meth:`ToolParser.extract`). Output that does not parse as calls is
plain content, never an error: a model may write a malformed call, and the client then gets its
text. While streaming, :meth:`ToolParser.content_end` says how much of the text so far is surely
content (the rest may be the start of a call and is held back until the output ends).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's ``name`` and its ``arguments`` as JSON text."""

    name: str
    arguments: str


def _call(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded JSON object with a string ``name`` and an object under one of
    ``args_keys`` (absent: no arguments), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (a stream holds them)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Turns a model's output into (content, calls)."""

    name: str

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole output: calls empty and content ``text`` when it holds no
        call that parses; content None when nothing but calls was written."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """While streaming: the length of the prefix of ``text`` (the output so far) that is
        content whatever comes next."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call(json.loads(body.strip()), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:  # one malformed call: the whole output is content (vLLM's rule)
                return text, []
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - held_back(text, self.START)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            if (call := _call(obj, ("parameters", "arguments"))) is None:
                return text, []
            calls.append(call)
            rest = body[i:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, []
            i = len(body) - len(rest)
        return None, calls

    def content_end(self, text: str) -> int:
        lead = text.lstrip()
        if not lead or lead.startswith("{") or lead.startswith(self.TAG) or self.TAG.startswith(lead):
            return 0  # nothing yet, or a call (the whole output is one): hold it all
        return len(text)


#: ``--tool-call-parser`` values.
TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
