"""OpenAI's Responses API (``POST /v1/responses``) as vLLM serves it: the request body and the
response object with its output items.

The request (:class:`ResponsesRequest`) is validated here (unknown fields are dropped by the
server's lenient mode, as vLLM does); :mod:`tpengine.server.responses` translates it into a chat
completions body and the chat result back into a :class:`ResponseObject`. Served: ``input`` as a
string or a list of items (messages with text parts, ``function_call``, ``function_call_output``;
``reasoning`` items are accepted and dropped), ``instructions``, function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``,
``json_schema``), ``reasoning``, ``max_output_tokens``, ``temperature``, ``top_p`` and vLLM's extra
sampling fields, ``stream``, ``store``, ``previous_response_id``. Images, files, hosted tools,
``background`` and ``conversation`` are refused by name.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal

import annotated_types as at
from pydantic import Strict

from tpengine.protocol.base import Problem, ProtocolModel
from tpengine.protocol.fields import (
    Flag,
    MinP,
    Neutral,
    NonEmptyStr,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TopK,
    TopP,
    Valid,
    as_json,
)
from tpengine.protocol.records import RecordModel
from tpengine.protocol.tagged import StrOrList, Tagged

_Str = Annotated[str, Strict(), Valid("a string")]
_Object = Annotated[dict[str, Any], Strict(), Valid("an object")]
_TEXT_ONLY = "tpengine serves text only"
_ItemStatus = Annotated[Literal["in_progress", "completed", "incomplete"],
                        Valid('"in_progress", "completed" or "incomplete"')]


# --- input ------------------------------------------------------------------------------------
class TextPart(ProtocolModel):
    """A text content part: ``input_text`` (what a user or system wrote), ``output_text`` (an
    assistant's earlier output, as the SDK sends it back), ``text``; ``annotations`` and
    ``logprobs`` of an output text are accepted and dropped."""

    type: Literal["input_text", "output_text", "text"]
    text: _Str
    annotations: Annotated[list[Any], Strict()] | None = None
    logprobs: Annotated[list[Any], Strict()] | None = None


class RefusalPart(ProtocolModel):
    """An assistant's earlier ``refusal`` part (its text goes to the template as content)."""

    type: Literal["refusal"]
    refusal: _Str

    @property
    def text(self) -> str:
        return self.refusal


_PART = Tagged({"input_text": TextPart, "output_text": TextPart, "text": TextPart, "refusal": RefusalPart},
               "a content part", refused={"input_image": _TEXT_ONLY, "input_file": _TEXT_ONLY,
                                          "input_audio": _TEXT_ONLY})
_Content = Annotated[Any, StrOrList(Annotated[Any, _PART], "a string or a list of content parts")]


def parts_text(content: str | list[Any]) -> str:
    """The text of a ``content`` value: the string, or its parts' texts joined with "\\n" (as chat
    text parts are joined)."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class MessageItem(ProtocolModel):
    """A message of the conversation: ``role`` "user", "system", "developer" (a system message
    to the chat template) or "assistant"; ``content`` a string or text parts. ``type`` "message" may
    be left out (OpenAI's easy input message); ``id`` and ``status`` are accepted."""

    MISSING: ClassVar[dict[str, str]] = {"role": 'is required: "user", "system", "developer" or "assistant"',
                                         "content": "is required: a string or a list of content parts"}

    type: Literal["message"] = "message"
    role: Annotated[Literal["user", "system", "developer", "assistant"],
                    Valid('"user", "system", "developer" or "assistant"')]
    content: _Content
    id: _Str | None = None
    status: _ItemStatus | None = None


class FunctionCallItem(ProtocolModel):
    """An earlier call of the model (``type`` "function_call"): ``call_id`` (what its output names),
    ``name``, ``arguments`` (JSON text); ``id`` and ``status`` are accepted."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: _Str
    id: _Str | None = None
    status: _ItemStatus | None = None


class FunctionCallOutputItem(ProtocolModel):
    """The result of a call (``type`` "function_call_output"): ``call_id`` of the call, ``output``
    (a string or text parts)."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: _Content
    id: _Str | None = None
    status: _ItemStatus | None = None


class ReasoningInputItem(ProtocolModel):
    """An earlier ``reasoning`` item: accepted and left out of the prompt (as chat templates drop
    earlier thoughts)."""

    type: Literal["reasoning"]
    id: _Str | None = None
    summary: Annotated[list[Any], Strict()] | None = None
    content: Annotated[list[Any], Strict()] | None = None
    encrypted_content: _Str | None = None
    status: _ItemStatus | None = None


_ITEM = Tagged({"message": MessageItem, "function_call": FunctionCallItem,
                "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningInputItem},
               "an input item", default="message",
               refused={"item_reference": "use previous_response_id for an earlier response's items"})
Input = Annotated[Any, StrOrList(Annotated[Any, _ITEM], "a non-empty string or a non-empty list of input items",
                                 non_empty=True)]


# --- tools, formats ---------------------------------------------------------------------------
class FunctionTool(ProtocolModel):
    """A function the model may call (the Responses API's flat shape): ``name``, ``description``,
    ``parameters`` (the JSON schema of its arguments), ``strict`` (accepted)."""

    type: Literal["function"]
    name: NonEmptyStr
    description: _Str | None = None
    parameters: Annotated[dict[str, Any], Strict(), Valid("a JSON schema (an object)")] | None = None
    strict: Flag | None = None


_HOSTED = "only function tools are served (tpengine runs no hosted tools)"
_TOOL = Tagged({"function": FunctionTool}, "a tool",
               refused={k: _HOSTED for k in ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                                             "code_interpreter", "image_generation", "mcp", "local_shell", "shell",
                                             "custom", "apply_patch")})


class FunctionToolChoice(ProtocolModel):
    """``{"type": "function", "name": ...}``: the model must call this function."""

    type: Literal["function"]
    name: NonEmptyStr


ToolChoice = Annotated[Literal["none", "auto", "required"] | FunctionToolChoice,
                       Valid('"none", "auto", "required" or {"type": "function", "name": ...}', nested=True)]


with warnings.catch_warnings():  # the JSON name "schema" shadows BaseModel's deprecated method
    warnings.filterwarnings("ignore", message='Field name "schema"')

    class TextFormat(ProtocolModel):
        """``text.format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` or
        ``{"type": "json_schema", "name", "schema", "description"?, "strict"?}``."""

        MISSING: ClassVar[dict[str, str]] = {"type": 'is required: "text", "json_object" or "json_schema"'}

        type: Annotated[Literal["text", "json_object", "json_schema"], Valid('"text", "json_object" or "json_schema"')]
        name: NonEmptyStr | None = None
        schema: Annotated[Annotated[dict[str, Any], Strict()] | Annotated[bool, Strict()],
                          Valid("a JSON schema (an object)")] | None = None
        description: _Str | None = None
        strict: Flag | None = None

        @classmethod
        def problems(cls, data: dict[str, Any]) -> list[Problem]:
            if data.get("type") == "json_schema":
                return [((k,), 'is required with "type": "json_schema"') for k in ("name", "schema") if k not in data]
            return [((k,), f'goes only with "type": "json_schema", got "type": {as_json(data.get("type"))}')
                    for k in ("name", "schema") if data.get(k) is not None]

        def response_format(self) -> dict[str, Any] | None:
            """The chat ``response_format`` of this format (None for text)."""
            if self.type == "text":
                return None
            if self.type == "json_object":
                return {"type": "json_object"}
            schema = {"name": self.name, "schema": self.schema, "description": self.description, "strict": self.strict}
            return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(ProtocolModel):
    """``text``: its ``format`` (:class:`TextFormat`) and ``verbosity`` (accepted)."""

    format: TextFormat | None = None
    verbosity: _Str | None = None


class ReasoningConfig(ProtocolModel):
    """``reasoning``: ``effort``, ``summary``, ``generate_summary`` (accepted: a server with a
    ``--reasoning-parser`` returns the model's thought as a ``reasoning`` item whatever they say)."""

    effort: _Str | None = None
    summary: _Str | None = None
    generate_summary: _Str | None = None


# --- the request ------------------------------------------------------------------------------
class ResponsesRequest(ProtocolModel):
    """A ``POST /v1/responses`` body (see the module). ``max_output_tokens`` >= 1 (absent: until EOS
    or the context limit, as vLLM); ``store`` (default true) keeps the response for
    ``previous_response_id`` and ``GET /v1/responses/{id}``; ``previous_response_id`` continues that
    response's conversation (its input and output, not its ``instructions``)."""

    MISSING: ClassVar[dict[str, str]] = {"input": "is required: a string or a list of input items"}

    model: _Str | None = None
    input: Input
    instructions: _Str | None = None
    max_output_tokens: Annotated[int, Strict(), at.Ge(1), Valid("an integer >= 1")] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[Annotated[Any, _TOOL]], Strict(), Valid("a list of tools", nested=True)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Flag | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: Flag | None = None
    stream_options: _Object | None = None
    store: Flag | None = None
    previous_response_id: NonEmptyStr | None = None
    metadata: _Object | None = None
    user: _Str | None = None
    include: Annotated[list[Annotated[str, Strict()]], Strict(), Valid("a list of strings")] | None = None
    truncation: Annotated[Literal["auto", "disabled"], Valid('"auto" or "disabled"')] | None = None
    service_tier: _Str | None = None
    prompt_cache_key: _Str | None = None
    safety_identifier: _Str | None = None
    max_tool_calls: Annotated[int, Strict(), at.Ge(1), Valid("an integer >= 1")] | None = None
    background: Annotated[bool, Strict(), Neutral((False,), "not supported by tpengine (responses run in the "
                                                            "foreground); only false")] | None = None
    conversation: Annotated[Any, Neutral((None,), "not supported by tpengine; use previous_response_id")] = None
    prompt: Annotated[Any, Neutral((None,), "not supported by tpengine (no stored prompts); send input")] = None
    top_logprobs: Annotated[int, Strict(), Neutral((0,), "not supported by tpengine's Responses API; use "
                                                         "/v1/chat/completions for logprobs")] | None = None
    # vLLM's extra sampling fields
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None

    SAMPLING_KEYS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                "repetition_penalty", "presence_penalty", "frequency_penalty")

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        """A required or named ``tool_choice`` without tools, or naming none of them."""
        choice, tools = data.get("tool_choice"), data.get("tools")
        if choice is None or choice in ("none", "auto"):
            return []
        if not tools:
            return [(("tool_choice",), f"needs tools to choose from, got tool_choice {as_json(choice)} and no tools")]
        names = [t.get("name") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
        if isinstance(choice, dict) and isinstance(choice.get("name"), str) and choice["name"] not in names:
            return [(("tool_choice", "name"), f"names no tool of this request: got {as_json(choice['name'])}, the "
                     f"tools are {', '.join(as_json(n) for n in names)}")]
        return []


# --- the response -----------------------------------------------------------------------------
class OutputText(RecordModel):
    """An ``output_text`` part of an output message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(RecordModel):
    """A ``message`` output item: the assistant's text."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText]


class FunctionCallOut(RecordModel):
    """A ``function_call`` output item: ``call_id`` is what the client's ``function_call_output``
    names."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(RecordModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(RecordModel):
    """A ``reasoning`` output item: the model's thought (``content``; no summary)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText]
    status: str = "completed"


class InputTokensDetails(RecordModel):
    cached_tokens: int = 0


class OutputTokensDetails(RecordModel):
    reasoning_tokens: int = 0


class ResponseUsage(RecordModel):
    """Token counts: ``input_tokens`` (the prompt, ``cached_tokens`` of it from the prefix cache),
    ``output_tokens`` (generated, thought included), ``total_tokens``."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(RecordModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(RecordModel):
    code: str
    message: str


class ResponseObject(RecordModel):
    """The ``response`` object (non-streamed body, ``GET /v1/responses/{id}``, and inside the stream's
    ``response.*`` events). ``status``: "in_progress" (stream start), "completed", "incomplete"
    (``max_output_tokens`` reached: ``incomplete_details.reason`` "max_output_tokens"), "failed"
    (``error`` set); the request's settings are echoed as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, Any] = {}
    model: str
    output: list[OutputMessage | FunctionCallOut | ReasoningOut] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
