"""Output records: one JSON line per request, in the shape its request came in.

Every record is built through a model of :mod:`tpengine.protocol.records` and written as its
``model_dump()``. Record shapes:

* simple: ``{"id", "text", "token_ids", "finish_reason", "usage": {"prompt_tokens",
  "completion_tokens", "prompt_tokens_details": {"cached_tokens"}}, "metrics": {"ttft_s",
  "latency_s"}}``; error: ``{"id", "error":
  {"message", "field"?, "line"?}}``. No two records share an id: the record of an invalid line
  whose id is already taken (a duplicate id) has id ``"<id>#line<N>"`` (``custom_id`` in the
  OpenAI shape), and ``--resume`` never counts an invalid-line record as a finished request.
* OpenAI Batch API (lines that came as batch requests): ``{"id": "batch_req_<line>",
  "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion or
  text_completion>}, "error": null}``; error: ``{"id", "custom_id", "response": null, "error":
  {"code", "message", "param", "line"}}``. The body's ``model`` is the served model.
"""

from __future__ import annotations

import time
from typing import Any

from tpengine.engine.outputs import RequestOutput
from tpengine.frontend.requests import ParsedRequest
from tpengine.protocol.records import (
    BatchError,
    BatchOutputLine,
    BatchResponse,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatResponseMessage,
    CompletionResponse,
    CompletionResponseChoice,
    Metrics,
    PromptTokensDetails,
    SimpleError,
    SimpleErrorRecord,
    SimpleRecord,
    SimpleUsage,
    UsageInfo,
)


def _secs(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def simple_record(out: RequestOutput) -> dict[str, Any]:
    """The simple-format record of a finished request (or its error record if ``out.error``)."""
    if out.error is not None:
        return error_record(out.request_id, out.error, out.error_field)
    return SimpleRecord(
        id=out.request_id,
        text=out.text,
        token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        usage=SimpleUsage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens)),
        metrics=Metrics(ttft_s=_secs(out.ttft_s), latency_s=_secs(out.latency_s)),
    ).model_dump()


def error_record(request_id: str, message: str, field: str | None = None, line: int | None = None) -> dict:
    """A simple-format error record; ``field``/``line`` are included when known."""
    rec = SimpleErrorRecord(id=request_id, error=SimpleError(message=message, field=field, line=line))
    return rec.model_dump(exclude_none=True)


def openai_record(
    req: ParsedRequest, out: RequestOutput, model: str, created: int | None = None
) -> dict[str, Any]:
    """The OpenAI Batch output line for ``req`` (format openai_chat / openai_completion).

    ``model``: the served model's name (the body's ``model``, as vLLM, is the one that ran, not the
    request's); ``created``: unix seconds (default now).
    """
    if out.error is not None:
        return openai_error_record(req.id, req.line, out.error, out.error_field, code="request_failed")
    n = req.line
    body = openai_body(out, req.format == "openai_chat", model, str(n), created)
    response = BatchResponse(request_id=f"req_{n}", body=body)
    return BatchOutputLine(id=f"batch_req_{n}", custom_id=req.id, response=response).model_dump()


def usage_info(out: RequestOutput) -> UsageInfo:
    """OpenAI ``usage`` of ``out``: prompt, completion and total tokens, cached prompt tokens."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def openai_body(out: RequestOutput, chat: bool, model: str, suffix: str,
                created: int | None = None) -> ChatCompletionResponse | CompletionResponse:
    """The OpenAI response body of finished ``out``: a ``chat.completion`` (id ``chatcmpl-<suffix>``)
    or a ``text_completion`` (id ``cmpl-<suffix>``); ``model`` the served model's name; ``created``
    unix seconds (default now). Shared by the batch job and the server."""
    created = int(time.time()) if created is None else created
    usage = usage_info(out)
    if chat:
        choice = ChatCompletionResponseChoice(message=ChatResponseMessage(content=out.text),
                                              finish_reason=out.finish_reason)
        return ChatCompletionResponse(id=f"chatcmpl-{suffix}", created=created, model=model, choices=[choice],
                                      usage=usage)
    choice = CompletionResponseChoice(text=out.text, finish_reason=out.finish_reason)
    return CompletionResponse(id=f"cmpl-{suffix}", created=created, model=model, choices=[choice], usage=usage)


def openai_error_record(
    custom_id: str, line: int, message: str, field: str | None = None, code: str = "invalid_request"
) -> dict[str, Any]:
    """An OpenAI Batch output line for a request that did not run (``line`` 1-based)."""
    err = BatchError(code=code, message=message, param=field, line=line)
    return BatchOutputLine(id=f"batch_req_{line}", custom_id=custom_id, error=err).model_dump()


def make_record(req: ParsedRequest | None, out: RequestOutput, model: str) -> dict[str, Any]:
    """The record for ``out`` in the shape its request came in (simple when ``req`` is None);
    ``model``: the served model's name (OpenAI records)."""
    if req is None or req.format == "simple":
        return simple_record(out)
    return openai_record(req, out, model)


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
