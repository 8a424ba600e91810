"""Tool calling on the chat endpoint: what a request's ``tool_choice`` asks of the output, and how
the output becomes OpenAI ``tool_calls`` (vLLM's behaviour).

* ``auto``: the model decides; the ``--tool-call-parser`` reads calls out of its text
  (:mod:`tpengine.frontend.tool_parsers`). Needs ``--enable-auto-tool-choice``.
* ``required``: the output is constrained to a JSON list of one or more ``{"name", "parameters"}``
  objects, each naming one of the tools with arguments valid under its schema (at most one with
  ``parallel_tool_calls`` false).
* a named function: the output is constrained to that function's arguments (its ``parameters``
  schema), and is the call's ``arguments``.
* ``none`` (or no tools): plain content.

A message with calls has ``finish_reason`` "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tpengine.frontend.tool_parsers import TOOL_PARSERS, ParsedCall, ToolParser
from tpengine.structured.params import StructuredOutputsParams

#: The error of ``tool_choice`` "auto" on a server started without a parser (vLLM's words).
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def new_call_id() -> str:
    """A tool call's id (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _params_schema(function: Any) -> dict[str, Any]:
    """A function's arguments schema: its ``parameters``, or, where it has none (absent or ``{}``), an
    object with no properties, so its call's arguments are ``{}`` (vLLM's rule)."""
    return dict(function.parameters) if function.parameters else {"type": "object", "properties": {}}


def required_schema(tools: list[Any], parallel: bool = True) -> dict[str, Any]:
    """The schema ``tool_choice`` "required" constrains the output to: a JSON list of one or more
    (one at most without ``parallel``) ``{"name", "parameters"}`` objects, each one tool's name and
    arguments valid under its schema. Each tool's ``$defs`` / ``definitions`` move to the list's root,
    where the ``$ref``s inside its parameters point (vLLM's layout; the protocol layer refuses a name
    two tools define differently)."""
    defs: dict[str, dict[str, Any]] = {}
    calls = []
    for t in tools:
        params = _params_schema(t.function)
        for key in ("$defs", "definitions"):
            if isinstance(params.get(key), dict):
                defs.setdefault(key, {}).update(params.pop(key))
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                       "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, **defs}


@dataclass(frozen=True)
class ToolUse:
    """How one request's output becomes tool calls: ``mode`` "auto" (``parser`` reads them),
    "required" or "named" (``name``: the function)."""

    mode: str
    parser: ToolParser | None = None
    name: str | None = None

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output. Output that does not parse as the mode's calls
        (a truncated or malformed one) is content with no calls."""
        if self.mode == "auto":
            return self.parser.extract(text)
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [ParsedCall(self.name, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                                  and isinstance(i.get("parameters"), dict) for i in items):
            return text, []
        return None, [ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]

    def content_end(self, text: str) -> int:
        """While streaming: how much of the output so far is surely content (0 for "required" and
        named: their whole output is the calls)."""
        return self.parser.content_end(text) if self.mode == "auto" else 0


def tool_use(body: Any, parser: str | None, enable_auto: bool) -> tuple[ToolUse | None, StructuredOutputsParams | None]:
    """What a validated chat request's tools ask: (its :class:`ToolUse` or None, the output
    constraint that ``required`` or a named choice adds, or None).

    Raises:
        ValueError: ``tool_choice`` "auto" (the default with tools) on a server without
            ``enable_auto`` and a ``parser`` (:data:`AUTO_NEEDS_FLAGS`).
    """
    mode = body.tool_mode
    if mode == "none":
        return None, None
    if mode == "auto":
        if not enable_auto or parser is None:
            raise ValueError(AUTO_NEEDS_FLAGS)
        return ToolUse("auto", parser=TOOL_PARSERS[parser]()), None
    if mode == "named":
        name = body.tool_choice.function.name
        function = next(t.function for t in body.tools if t.function.name == name)
        return ToolUse("named", name=name), StructuredOutputsParams(json=_params_schema(function))
    return ToolUse("required"), StructuredOutputsParams(json=required_schema(body.tools,
                                                                             body.parallel_tool_calls is not False))
