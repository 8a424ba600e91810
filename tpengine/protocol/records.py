"""Output record shapes: the simple record and its error, the OpenAI ``text_completion`` and
``chat.completion`` bodies (vLLM's field names), and the OpenAI Batch output line.

Build a record with the model and write ``model.model_dump()`` (:class:`SimpleErrorRecord`:
``model_dump(exclude_none=True)``, so an unknown ``field`` or ``line`` is left out). Token counts
are numbers of tokens; times are seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class RecordModel(BaseModel):
    """Base of the output records: no field beyond the declared ones."""

    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(RecordModel):
    """``cached_tokens``: prompt tokens whose KV came from the prefix cache."""

    cached_tokens: int = 0


class SimpleUsage(RecordModel):
    """A simple record's token counts."""

    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails


class UsageInfo(RecordModel):
    """OpenAI ``usage``: ``total_tokens`` = prompt + completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Metrics(RecordModel):
    """Seconds from arrival to the first token (``ttft_s``) and to the finish (``latency_s``)."""

    ttft_s: float | None = None
    latency_s: float | None = None


class SimpleRecord(RecordModel):
    """A finished simple-format request: generated ``text`` and ``token_ids``, ``finish_reason``
    ("stop" | "length" | "abort")."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: SimpleUsage
    metrics: Metrics


class SimpleError(RecordModel):
    """What went wrong: ``message``, the ``field`` path and 1-based ``line`` when known."""

    message: str
    field: str | None = None
    line: int | None = None


class SimpleErrorRecord(RecordModel):
    """A simple-format request that did not run (dump with ``exclude_none=True``)."""

    id: str
    error: SimpleError


class CompletionResponseChoice(RecordModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(RecordModel):
    """An OpenAI ``/v1/completions`` response body."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class ChatResponseMessage(RecordModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(RecordModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(RecordModel):
    """An OpenAI ``/v1/chat/completions`` response body."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class BatchResponse(RecordModel):
    """The ``response`` of a Batch output line."""

    status_code: int = 200
    request_id: str
    body: ChatCompletionResponse | CompletionResponse


class BatchError(RecordModel):
    """The ``error`` of a Batch output line: ``code`` "invalid_request" (the line was rejected
    before the run) or "request_failed" (it failed while running), ``param`` the field path,
    ``line`` the 1-based input line."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchOutputLine(RecordModel):
    """One OpenAI Batch API output line: exactly one of ``response`` and ``error`` is set."""

    id: str
    custom_id: str
    response: BatchResponse | None = None
    error: BatchError | None = None
