"""Streaming response shapes: the server-sent-event chunks of ``/v1/completions`` (``object``
"text_completion") and ``/v1/chat/completions`` (``object`` "chat.completion.chunk"), in OpenAI's
and vLLM's field names, and the HTTP error body. Each SSE event is ``data: <chunk JSON>\\n\\n``;
a stream ends with ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from typing import ClassVar, Literal

from tpengine.protocol.records import ChatLogprobs, CompletionLogprobs, FunctionCallOut, RecordModel, UsageInfo


class CompletionStreamChoice(RecordModel):
    """One sample's delta (``index``); ``logprobs``: those of the delta's tokens, when asked."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionStreamResponse(RecordModel):
    """One chunk of a streamed ``/v1/completions`` response; the usage-only chunk (``stream_options.
    include_usage``) has ``choices`` [] and ``usage`` set."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class DeltaToolCall(RecordModel):
    """A streamed call (OpenAI's ``delta.tool_calls`` item): tpengine sends each call whole, in one
    chunk: ``index`` (its place among the message's calls), ``id``, ``type``, ``function`` with
    ``name`` and all of ``arguments``."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaMessage(RecordModel):
    """The new part of the assistant message: ``role`` only in a choice's first chunk, then
    ``content`` (OpenAI's shape: a field that is not set is left out, not ``null``)."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("role", "content", "reasoning_content", "tool_calls")

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(RecordModel):
    """One sample's delta (``index``); ``logprobs``: those of the delta's tokens, when asked."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(RecordModel):
    """One chunk of a streamed ``/v1/chat/completions`` response (see :class:`CompletionStreamResponse`
    for the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ErrorInfo(RecordModel):
    """OpenAI's error object: ``type`` e.g. "invalid_request_error" (400) or "server_error" (5xx);
    ``param`` the offending field's path; ``code`` the HTTP status."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(RecordModel):
    """The body of an HTTP error response, and of an error event inside a stream."""

    error: ErrorInfo
