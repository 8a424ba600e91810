"""Output records: one JSON line per request, in the shape its request came in.

Every record is built through a model of :mod:`tpengine.protocol.records` and written as its
``model_dump()``. Record shapes:

* simple: ``{"id", "text", "token_ids", "finish_reason", "logprobs"?, "prompt_logprobs"?,
  "usage": {"prompt_tokens", "completion_tokens", "prompt_tokens_details": {"cached_tokens"}},
  "metrics": {"ttft_s", "latency_s"}}`` (``logprobs`` / ``prompt_logprobs`` when the request
  asked: :mod:`tpengine.frontend.logprobs`); with ``n > 1``, ``{"id", "outputs": [{"index",
  "text", "token_ids", "finish_reason", "logprobs"?}, ...], "prompt_logprobs"?, "usage",
  "metrics"}`` (``completion_tokens`` over every sample); error: ``{"id", "error":
  {"message", "field"?, "line"?}}``. No two records share an id: the record of an invalid line
  whose id is already taken (a duplicate id) has id ``"<id>#line<N>"`` (``custom_id`` in the
  OpenAI shape), and ``--resume`` never counts an invalid-line record as a finished request.
* OpenAI Batch API (lines that came as batch requests): ``{"id": "batch_req_<line>",
  "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion or
  text_completion>}, "error": null}``; error: ``{"id", "custom_id", "response": null, "error":
  {"code", "message", "param", "line"}}``. The body's ``model`` is the served model; its
  ``choices`` hold one entry per sample (``index`` i), ``choices[i].logprobs`` OpenAI's shapes
  when asked, and vLLM's ``prompt_logprobs`` (completions: on each choice; chat: at the top).
"""

from __future__ import annotations

import time
from typing import Any

from tpengine.engine.outputs import CompletionOutput, EngineOutput, PositionLogprobs
from tpengine.frontend.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    openai_prompt_logprobs,
    simple_logprobs,
)
from tpengine.frontend.reasoning import ReasoningParser
from tpengine.frontend.requests import EchoPrompt, ParsedRequest
from tpengine.frontend.tools import ToolUse, new_call_id
from tpengine.protocol.records import (
    BatchError,
    BatchOutputLine,
    BatchResponse,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatResponseMessage,
    CompletionLogprobs,
    CompletionResponse,
    CompletionResponseChoice,
    FunctionCallOut,
    Metrics,
    PromptTokensDetails,
    SimpleError,
    SimpleErrorRecord,
    SimpleMultiRecord,
    SimpleRecord,
    SimpleSample,
    SimpleUsage,
    ToolCallOut,
    UsageInfo,
)


def _secs(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def simple_record(out: EngineOutput) -> dict[str, Any]:
    """The simple-format record of a finished request (or its error record if ``out.error``): one
    sample's fields at the top, or ``outputs`` with n > 1 samples."""
    if out.error is not None:
        return error_record(out.request_id, out.error, out.error_field)
    usage = SimpleUsage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=out.num_output_tokens,
                        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))
    metrics = Metrics(ttft_s=_secs(out.ttft_s), latency_s=_secs(out.latency_s),
                      spec_num_draft_tokens=out.spec_num_draft_tokens,
                      spec_num_accepted_tokens=out.spec_num_accepted_tokens)
    prompt_logprobs = simple_logprobs(out.prompt_logprobs)
    if len(out.outputs) > 1:
        samples = [SimpleSample(index=o.index, text=o.text, token_ids=list(o.token_ids), finish_reason=o.finish_reason,
                                logprobs=simple_logprobs(o.logprobs)) for o in out.outputs]
        return SimpleMultiRecord(id=out.request_id, outputs=samples, prompt_logprobs=prompt_logprobs, usage=usage,
                                 metrics=metrics).model_dump()
    return SimpleRecord(
        id=out.request_id,
        text=out.text,
        token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        logprobs=simple_logprobs(out.outputs[0].logprobs) if out.outputs else None,
        prompt_logprobs=prompt_logprobs,
        usage=usage,
        metrics=metrics,
    ).model_dump()


def error_record(request_id: str, message: str, field: str | None = None, line: int | None = None) -> dict:
    """A simple-format error record; ``field``/``line`` are included when known."""
    rec = SimpleErrorRecord(id=request_id, error=SimpleError(message=message, field=field, line=line))
    return rec.model_dump(exclude_none=True)


def openai_record(
    req: ParsedRequest, out: EngineOutput, model: str, created: int | None = None, echo: EchoPrompt | None = None,
    reasoning: ReasoningParser | None = None
) -> dict[str, Any]:
    """The OpenAI Batch output line for ``req`` (format openai_chat / openai_completion).

    ``model``: the served model's name (the body's ``model``, as vLLM, is the one that ran, not the
    request's); ``created``: unix seconds (default now); ``echo``: the prompt a completions body's
    ``echo`` puts first; ``reasoning``: a chat line's reasoning split (``--reasoning-parser``), as the
    server's.
    """
    if out.error is not None:
        return openai_error_record(req.id, req.line, out.error, out.error_field, code="request_failed")
    n = req.line
    body = openai_body(out, req.format == "openai_chat", model, str(n), created, echo, req.tools, reasoning)
    response = BatchResponse(request_id=f"req_{n}", body=body)
    return BatchOutputLine(id=f"batch_req_{n}", custom_id=req.id, response=response).model_dump()


def usage_info(*outs: EngineOutput) -> UsageInfo:
    """OpenAI ``usage`` of one or more outputs (the prompts of one completions request): prompt,
    completion (every sample's) and total tokens, cached prompt tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(o.num_output_tokens for o in outs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outs)))


def completion_text(o: CompletionOutput, echo: EchoPrompt | None, prompt_logprobs: list | None = None,
                    text: str | None = None, positions: list[PositionLogprobs] | None = None,
                    text_offset: int = 0) -> tuple[str, CompletionLogprobs | None]:
    """The ``text`` and legacy ``logprobs`` of one ``text_completion`` choice: sample ``o`` (or, in a
    stream, the delta ``text`` and its ``positions``, starting ``text_offset`` characters into the
    completion), with ``echo``'s prompt first when given (its tokens' logprobs from the engine's
    ``prompt_logprobs``); logprobs None when the request did not ask for them."""
    text = o.text if text is None else text
    positions = o.logprobs if positions is None else positions
    if echo is None:
        return text, None if positions is None else completion_logprobs(positions, text_offset)
    lp = None if positions is None else echo_logprobs(echo.tokens or [], prompt_logprobs, echo.logprobs or 0,
                                                      positions, echo.offset + text_offset)
    return echo.text + text, lp


def completion_body(outs: list[EngineOutput], echos: list[EchoPrompt | None], model: str, suffix: str,
                    created: int | None = None, n: int = 1) -> CompletionResponse:
    """The ``text_completion`` body (id ``cmpl-<suffix>``) of the finished outputs of one request's
    prompts, in order, each asked for ``n`` samples: choice ``index`` = prompt * n + sample
    (OpenAI's and vLLM's order), each prompt's ``echo`` before its samples; ``usage`` over every
    prompt."""
    created = int(time.time()) if created is None else created
    choices = []
    for i, (out, echo) in enumerate(zip(outs, echos, strict=True)):
        prompt_logprobs = openai_prompt_logprobs(out.prompt_logprobs)  # vLLM's, on every choice of the prompt
        for o in out.outputs:
            text, lp = completion_text(o, echo, out.prompt_logprobs)
            choices.append(CompletionResponseChoice(index=i * n + o.index, text=text, finish_reason=o.finish_reason,
                                                    prompt_logprobs=prompt_logprobs, logprobs=lp))
    return CompletionResponse(id=f"cmpl-{suffix}", created=created, model=model, choices=choices,
                              usage=usage_info(*outs))


def chat_message(text: str, finish_reason: str | None, tools: ToolUse | None,
                 reasoning: ReasoningParser | None = None, token_ids: list[int] | tuple[int, ...] = ()
                 ) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of a finished sample's ``text`` (its ``token_ids``) and its finish reason:
    with ``reasoning``, the thought split off into ``reasoning_content``; with ``tools``, the calls
    read from the rest (:meth:`ToolUse.extract`; then the reason is "tool_calls")."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.split(text, token_ids)
        text = text or ""
    if tools is None:
        return ChatResponseMessage(content=text if text or thought is None else None, reasoning_content=thought), \
            finish_reason
    content, calls = tools.extract(text)
    if not calls:
        return ChatResponseMessage(content=text if text or thought is None else None, reasoning_content=thought), \
            finish_reason
    out = [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    return ChatResponseMessage(content=content, reasoning_content=thought, tool_calls=out), "tool_calls"


def openai_body(out: EngineOutput, chat: bool, model: str, suffix: str, created: int | None = None,
                echo: EchoPrompt | None = None, tools: ToolUse | None = None,
                reasoning: ReasoningParser | None = None) -> ChatCompletionResponse | CompletionResponse:
    """The OpenAI response body of finished ``out``: a ``chat.completion`` (id ``chatcmpl-<suffix>``;
    ``tools``: how its text becomes tool calls, ``reasoning``: its thought's tags,
    :func:`chat_message`) or a ``text_completion`` (id
    ``cmpl-<suffix>``, :func:`completion_body`; ``echo`` its echoed prompt), one choice per sample;
    ``model`` the served model's name; ``created`` unix seconds (default now). Shared by the batch
    job and the server."""
    created = int(time.time()) if created is None else created
    if not chat:
        return completion_body([out], [echo], model, suffix, created)
    choices = []
    for o in out.outputs:
        message, reason = chat_message(o.text, o.finish_reason, tools, reasoning, o.token_ids)
        choices.append(ChatCompletionResponseChoice(index=o.index, message=message, finish_reason=reason,
                                                    logprobs=None if o.logprobs is None else chat_logprobs(o.logprobs)))
    return ChatCompletionResponse(id=f"chatcmpl-{suffix}", created=created, model=model, choices=choices,
                                  usage=usage_info(out), prompt_logprobs=openai_prompt_logprobs(out.prompt_logprobs))


def openai_error_record(
    custom_id: str, line: int, message: str, field: str | None = None, code: str = "invalid_request"
) -> dict[str, Any]:
    """An OpenAI Batch output line for a request that did not run (``line`` 1-based)."""
    err = BatchError(code=code, message=message, param=field, line=line)
    return BatchOutputLine(id=f"batch_req_{line}", custom_id=custom_id, error=err).model_dump()


def make_record(req: ParsedRequest | None, out: EngineOutput, model: str, echo: EchoPrompt | None = None,
                reasoning: ReasoningParser | None = None) -> dict[str, Any]:
    """The record for ``out`` in the shape its request came in (simple when ``req`` is None);
    ``model``: the served model's name (OpenAI records); ``echo``, ``reasoning``: see :func:`openai_record`."""
    if req is None or req.format == "simple":
        return simple_record(out)
    return openai_record(req, out, model, echo=echo, reasoning=reasoning)


def record_id(record: dict[str, Any]) -> str | None:
    """The request id a record belongs to (``custom_id`` for OpenAI Batch lines)."""
    rid = record.get("custom_id", record.get("id"))
    return rid if isinstance(rid, str) else None


def is_validation_error(record: dict[str, Any]) -> int | None:
    """The line number if ``record`` reports an invalid request line (written before the run:
    a simple error with "line", or an OpenAI error with code "invalid_request"), else None."""
    err = record.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("line"), int):
        return None
    if "custom_id" in record and err.get("code") != "invalid_request":
        return None
    return err["line"]
