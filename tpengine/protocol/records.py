"""Output record shapes: the simple record and its error, the OpenAI ``text_completion`` and
``chat.completion`` bodies (vLLM's field names), and the OpenAI Batch output line.

Build a record with the model and write ``model.model_dump()`` (:class:`SimpleErrorRecord`:
``model_dump(exclude_none=True)``, so an unknown ``field`` or ``line`` is left out). Token counts
are numbers of tokens; times are seconds.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_serializer


class RecordModel(BaseModel):
    """Base of the output records: no field beyond the declared ones; the fields named in
    ``OMIT_NONE`` are left out of the dump when None (fields a request has only when it asked)."""

    model_config = ConfigDict(extra="forbid")
    OMIT_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> Any:
        out = handler(self)
        for k in self.OMIT_NONE:
            if k in out and out[k] is None:
                del out[k]
        return out


# --- logprobs ---------------------------------------------------------------------------------
class TokenLogprob(RecordModel):
    """One token's logprob in a simple record: ``token_id``, its text ``token``, ``logprob``
    (natural log; -inf is written as -9999.0, as vLLM)."""

    token_id: int
    token: str | None
    logprob: float


class SimplePositionLogprobs(TokenLogprob):
    """One position of a simple record's ``logprobs`` / ``prompt_logprobs``: the token there and
    the ``top_logprobs`` most likely tokens, most likely first."""

    top_logprobs: list[TokenLogprob]


class CompletionLogprobs(RecordModel):
    """OpenAI's legacy completions ``logprobs``: per token (the echoed prompt's, then the generated
    ones) its text (``tokens``), logprob (``token_logprobs``; null for the first prompt token),
    ``{text: logprob}`` of the top tokens and the chosen one (``top_logprobs``; null there too),
    and the character offset of its text in the choice's text (``text_offset``)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatTopLogprob(RecordModel):
    """One of a chat token's ``top_logprobs``: ``token`` text, ``logprob``, the text's UTF-8
    ``bytes``."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    """One generated token in a chat ``logprobs.content``, with its ``top_logprobs``."""

    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(RecordModel):
    """OpenAI's chat ``choices[i].logprobs``: ``content``, one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(RecordModel):
    """vLLM's ``prompt_logprobs`` value of one token at one position: ``logprob``, ``rank`` (1 =
    most likely), ``decoded_token``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's OpenAI ``prompt_logprobs``: per prompt position None (the first) or ``{token id: ...}``
#: of the prompt's token there and the top tokens.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


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
    """Seconds from arrival to the first token (``ttft_s``) and to the finish (``latency_s``); with
    speculative decoding, the request's proposed tokens (``spec_num_draft_tokens``) and how many of them
    were accepted (``spec_num_accepted_tokens``), left out without it."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("spec_num_draft_tokens", "spec_num_accepted_tokens")

    ttft_s: float | None = None
    latency_s: float | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None


class SimpleRecord(RecordModel):
    """A finished simple-format request of one sample: generated ``text`` and ``token_ids``,
    ``finish_reason`` ("stop" | "length" | "abort"); ``logprobs`` (one per generated token) and
    ``prompt_logprobs`` (one per prompt token, the first None) only when the request asked."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("logprobs", "prompt_logprobs")

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SimplePositionLogprobs] | None = None
    prompt_logprobs: list[SimplePositionLogprobs | None] | None = None
    usage: SimpleUsage
    metrics: Metrics


class SimpleSample(RecordModel):
    """One of the ``outputs`` of an ``n > 1`` simple record."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("logprobs",)

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SimplePositionLogprobs] | None = None


class SimpleMultiRecord(RecordModel):
    """A finished simple-format request with ``n > 1``: its ``outputs`` (n samples);
    ``usage.completion_tokens`` counts every sample's tokens."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    id: str
    outputs: list[SimpleSample]
    prompt_logprobs: list[SimplePositionLogprobs | None] | None = None
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
    """One choice; ``prompt_logprobs`` (vLLM's) only when asked."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(RecordModel):
    """An OpenAI ``/v1/completions`` response body."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class FunctionCallOut(RecordModel):
    """A call's function: ``name`` and ``arguments`` (JSON text)."""

    name: str
    arguments: str


class ToolCallOut(RecordModel):
    """One call of the assistant (OpenAI's ``tool_calls`` item)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(RecordModel):
    """The assistant's message: ``content`` (null when it only called tools or only thought),
    ``reasoning_content`` (a thinking model's thought, with a reasoning parser), ``tool_calls``
    (only when it called some)."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning_content")

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionResponseChoice(RecordModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(RecordModel):
    """An OpenAI ``/v1/chat/completions`` response body; ``prompt_logprobs`` (vLLM's, at the top
    level) only when asked."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class TokenizeResponse(RecordModel):
    """vLLM's ``/tokenize`` response: the ``tokens``, their ``count``, the server's
    ``max_model_len``, and each token's string when asked (``token_strs``, else null)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(RecordModel):
    """vLLM's ``/detokenize`` response: the text of the tokens (``prompt``)."""

    prompt: str


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
