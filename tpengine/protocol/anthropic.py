"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as vLLM and
llama-server serve it: the request body, the message and its content blocks, the error shape.

The request (:class:`MessagesRequest`) is validated here (unknown fields are dropped by the
server's lenient mode); :mod:`tpengine.server.anthropic_messages` translates it into a chat
completions body and the chat result back into a :class:`MessageOut`. Served: ``system`` (a string
or text blocks), ``messages`` with ``text``, ``tool_use`` and ``tool_result`` blocks (``thinking``
blocks of earlier turns are accepted and dropped), ``tools`` (custom tools: ``name``,
``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``), ``max_tokens`` (required), ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``stream``, ``metadata``, ``thinking``, ``output_config.format`` (a JSON
schema the output follows). Images, documents and Anthropic's
server tools are refused by name.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal

import annotated_types as at
from pydantic import Strict

from tpengine.protocol.base import Problem, ProtocolModel
from tpengine.protocol.fields import Flag, NonEmptyStr, Temperature, TopK, TopP, Valid, as_json
from tpengine.protocol.records import RecordModel
from tpengine.protocol.tagged import StrOrList, Tagged

_Str = Annotated[str, Strict(), Valid("a string")]
_Object = Annotated[dict[str, Any], Strict(), Valid("an object")]
_TEXT_ONLY = "tpengine serves text only"


class TextBlock(ProtocolModel):
    """``{"type": "text", "text": ...}`` (``citations`` and ``cache_control`` accepted)."""

    type: Literal["text"]
    text: _Str
    citations: Any = None
    cache_control: _Object | None = None


_TEXT_BLOCK = Tagged({"text": TextBlock}, "a text block", refused={"image": _TEXT_ONLY, "document": _TEXT_ONLY})
_TextContent = Annotated[Any, StrOrList(Annotated[Any, _TEXT_BLOCK], "a string or a list of text blocks")]


def blocks_text(content: str | list[Any]) -> str:
    """The text of a string or of text blocks (joined with "\\n", as chat text parts are)."""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class ToolUseBlock(ProtocolModel):
    """An assistant's call: ``id`` (what the ``tool_result`` names), ``name``, ``input`` (the arguments)."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: _Object
    cache_control: _Object | None = None


class ToolResultBlock(ProtocolModel):
    """A user's ``tool_result``: ``tool_use_id`` of the call, ``content`` (a string or text blocks;
    absent: empty), ``is_error`` (accepted)."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: _TextContent | None = None
    is_error: Flag | None = None
    cache_control: _Object | None = None


class ThinkingBlock(ProtocolModel):
    """An earlier turn's ``thinking`` (or ``redacted_thinking``) block: accepted, left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: _Str | None = None
    signature: _Str | None = None
    data: _Str | None = None


_BLOCK = Tagged({"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                 "thinking": ThinkingBlock, "redacted_thinking": ThinkingBlock}, "a content block",
                refused={"image": _TEXT_ONLY, "document": _TEXT_ONLY, "search_result": _TEXT_ONLY,
                         "server_tool_use": "tpengine runs no server tools"})



class InputMessage(ProtocolModel):
    """One turn: ``role`` "user" or "assistant", ``content`` a string or content blocks
    (``tool_use`` only in an assistant turn, ``tool_result`` only in a user turn)."""

    MISSING: ClassVar[dict[str, str]] = {"role": 'is required: "user" or "assistant"',
                                         "content": "is required: a string or a list of content blocks"}

    role: Annotated[Literal["user", "assistant"], Valid('"user" or "assistant" (the system prompt is the '
                                                        'top-level "system" field)')]
    content: Annotated[Any, StrOrList(Annotated[Any, _BLOCK], "a string or a list of content blocks")]

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        content, role = data.get("content"), data.get("role")
        if not isinstance(content, list):
            return []
        wrong = {"user": "tool_use", "assistant": "tool_result"}.get(role) if isinstance(role, str) else None
        return [(("content", i, "type"), f"a {wrong} block belongs to "
                 f"{'an assistant' if wrong == 'tool_use' else 'a user'} turn, got it in a {role} turn")
                for i, b in enumerate(content) if isinstance(b, dict) and wrong and b.get("type") == wrong]


class ToolDefinition(ProtocolModel):
    """A custom tool: ``name``, ``description``, ``input_schema`` (the JSON schema of its input)."""

    MISSING: ClassVar[dict[str, str]] = {"input_schema": "is required: the JSON schema of the tool's input"}

    type: Annotated[Literal["custom"], Valid('"custom" (or left out); tpengine runs no server tools')] | None = None
    name: NonEmptyStr
    description: _Str | None = None
    input_schema: Annotated[dict[str, Any], Strict(), Valid("a JSON schema (an object)")]
    cache_control: _Object | None = None


class ToolChoice(ProtocolModel):
    """``{"type": "auto" | "any" | "tool" | "none"}``; ``name`` with (only with) "tool";
    ``disable_parallel_tool_use`` (at most one call)."""

    MISSING: ClassVar[dict[str, str]] = {"type": 'is required: "auto", "any", "tool" or "none"'}

    type: Annotated[Literal["auto", "any", "tool", "none"], Valid('"auto", "any", "tool" or "none"')]
    name: NonEmptyStr | None = None
    disable_parallel_tool_use: Flag | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        if data.get("type") == "tool" and data.get("name") is None:
            return [(("name",), 'is required with "type": "tool": the tool to call')]
        if data.get("type") != "tool" and data.get("name") is not None:
            return [(("name",), f'goes only with "type": "tool", got "type": {as_json(data.get("type"))}')]
        return []


class ThinkingConfig(ProtocolModel):
    """``thinking``: ``{"type": "enabled", "budget_tokens": n}`` or ``{"type": "disabled"}`` (accepted:
    a server with a ``--reasoning-parser`` returns the model's thought as a ``thinking`` block)."""

    type: Annotated[Literal["enabled", "disabled", "adaptive"], Valid('"enabled", "disabled" or "adaptive"')]
    budget_tokens: Annotated[int, Strict(), at.Ge(0), Valid("an integer >= 0")] | None = None


with warnings.catch_warnings():  # the JSON name "schema" shadows BaseModel's deprecated method
    warnings.filterwarnings("ignore", message='Field name "schema"')

    class OutputFormat(ProtocolModel):
        """``output_config.format``: ``{"type": "json_schema", "schema": {...}}``, the output follows the schema."""

        type: Annotated[Literal["json_schema"], Valid('"json_schema"')]
        schema: Annotated[dict[str, Any], Strict(), Valid("a JSON schema (an object)")]


class OutputConfig(ProtocolModel):
    """``output_config``: ``format`` (structured output, :class:`OutputFormat`), ``effort`` (accepted)."""

    format: OutputFormat | None = None
    effort: _Str | None = None


class MessagesRequest(ProtocolModel):
    """A ``POST /v1/messages`` body (see the module): ``model``, ``messages`` (non-empty), ``max_tokens``
    (required, >= 1), the rest optional. ``temperature`` as vLLM takes it (>= 0; 0 greedy)."""

    MISSING: ClassVar[dict[str, str]] = {"max_tokens": "is required: the most tokens to generate (an integer >= 1)",
                                         "messages": "is required: a non-empty list of messages"}

    model: _Str | None = None
    messages: Annotated[list[InputMessage], Strict(), at.MinLen(1),
                        Valid('a non-empty list of {"role", "content"} messages', nested=True)]
    max_tokens: Annotated[int, Strict(), at.Ge(1), Valid("an integer >= 1")]
    system: _TextContent | None = None
    stop_sequences: Annotated[list[Annotated[str, Strict(), at.MinLen(1)]], Strict(),
                              Valid("a list of non-empty strings")] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    tools: Annotated[list[ToolDefinition], Strict(), Valid("a list of tools", nested=True)] | None = None
    tool_choice: ToolChoice | None = None
    stream: Flag | None = None
    metadata: _Object | None = None
    thinking: ThinkingConfig | None = None
    service_tier: _Str | None = None
    output_config: OutputConfig | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        """A ``tool_choice`` "any" or "tool" without tools, or naming none of them."""
        choice, tools = data.get("tool_choice"), data.get("tools")
        if not isinstance(choice, dict) or choice.get("type") not in ("any", "tool"):
            return []
        if not tools:
            return [(("tool_choice",), f"needs tools to choose from, got tool_choice {as_json(choice)} and no tools")]
        names = [t.get("name") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
        if choice.get("type") == "tool" and isinstance(choice.get("name"), str) and choice["name"] not in names:
            return [(("tool_choice", "name"), f"names no tool of this request: got {as_json(choice['name'])}, the "
                     f"tools are {', '.join(as_json(n) for n in names)}")]
        return []


class CountTokensRequest(ProtocolModel):
    """A ``POST /v1/messages/count_tokens`` body: what a Messages request's prompt would hold."""

    model: _Str | None = None
    messages: Annotated[list[InputMessage], Strict(), at.MinLen(1),
                        Valid('a non-empty list of {"role", "content"} messages', nested=True)]
    system: _TextContent | None = None
    tools: Annotated[list[ToolDefinition], Strict(), Valid("a list of tools", nested=True)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


# --- the response -----------------------------------------------------------------------------
class TextOut(RecordModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(RecordModel):
    """The model's thought (with a ``--reasoning-parser``); ``signature`` is empty (nothing to verify)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(RecordModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any  # the arguments: an object, as the tool's input_schema asks


class Usage(RecordModel):
    """``input_tokens`` (the prompt), ``output_tokens``; ``cache_read_input_tokens``: prompt tokens
    whose KV came from the prefix cache."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(RecordModel):
    """The assistant's message: ``content`` blocks, ``stop_reason`` ("end_turn", "max_tokens",
    "stop_sequence" with ``stop_sequence`` the one matched, "tool_use"; None in ``message_start`` and
    for a request aborted by a shutdown), ``usage``."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextOut | ThinkingOut | ToolUseOut]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class ErrorDetail(RecordModel):
    type: str
    message: str


class ErrorBody(RecordModel):
    """Anthropic's error body (and the stream's ``error`` event): ``{"type": "error", "error":
    {"type": "invalid_request_error" | "not_found_error" | "api_error" | ..., "message"}}``."""

    type: Literal["error"] = "error"
    error: ErrorDetail
