"""One OpenAI request on the server: parse and tokenize it (through the same protocol layer and
tokenizing code as the batch job), and turn the engine's outputs into a response body or SSE chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tpengine.engine.outputs import EngineOutput
from tpengine.frontend.logprobs import chat_logprobs, completion_logprobs
from tpengine.frontend.output import openai_body, usage_info
from tpengine.frontend.requests import (
    ParsedRequest,
    RequestValidationError,
    failure_message,
    make_params,
    template_options,
    to_token_ids,
)
from tpengine.protocol import ChatCompletionRequest, CompletionRequest
from tpengine.protocol.errors import field_errors
from tpengine.protocol.stream import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
)
from tpengine.sampling_params import SamplingParams

FORMATS = {"chat": "openai_chat", "completion": "openai_completion"}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable", 500: "server_error"}


class HTTPProblem(Exception):
    """A request the server answers with an error: HTTP ``status``, the ``param`` at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "server_error"),
                         param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


@dataclass
class Prepared:
    """A request ready for the engine: its id, format, prompt ids, params and streaming options."""

    request_id: str
    chat: bool
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int


def prepare_request(obj: Any, kind: str, tokenizer, vocab_size: int, max_model_len: int, model_name: str,
                    defaults: Mapping[str, Any]) -> Prepared:
    """Validate an OpenAI request body (``kind`` "chat" or "completion") and tokenize it.

    Raises:
        HTTPProblem: 400 for a body that is not valid (naming the field, as the batch job does), a
            prompt the tokenizer or chat template refuses, or one too long for ``max_model_len``;
            404 for a ``model`` other than ``model_name``.
    """
    chat = kind == "chat"
    if not isinstance(obj, dict):
        raise HTTPProblem(400, "the request body must be a JSON object")
    try:
        body = (ChatCompletionRequest if chat else CompletionRequest).model_validate(obj)
    except ValidationError as e:
        errs = field_errors(e)
        raise HTTPProblem(400, "; ".join((f"{f}: " if f else "") + m for f, m in errs), errs[0][0]) from None
    if body.model is not None and body.model != model_name:
        raise HTTPProblem(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`", "model")
    if body.stream and body.prompt_logprobs is not None:  # vLLM refuses it too
        raise HTTPProblem(400, "prompt_logprobs are not available when stream is true; ask without streaming",
                          "prompt_logprobs")
    fmt = FORMATS[kind]
    payload_kind, payload = body.prompt_payload()
    try:
        params = make_params(fmt, defaults, body.sampling_kwargs())
    except (TypeError, ValueError) as e:
        raise HTTPProblem(400, f"invalid sampling parameters: {e}") from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    req = ParsedRequest(rid, 0, payload_kind, fmt, payload, params, body.model, template_options(body, payload_kind))
    field = "messages" if chat else "prompt"
    try:
        ids = to_token_ids(req, tokenizer, vocab_size)
    except RequestValidationError as e:
        raise HTTPProblem(400, str(e), (e.field or field).removeprefix("body.")) from None
    except Exception as e:  # noqa: BLE001 -- the template's raise_exception, a lone surrogate: this request's
        raise HTTPProblem(400, failure_message(req, e), field) from None
    if len(ids) >= max_model_len:
        raise HTTPProblem(400, f"the prompt has {len(ids)} tokens, but max_model_len is {max_model_len} (the "
                          f"prompt must be at most {max_model_len - 1} tokens to leave room for one output "
                          "token)", field)
    options = body.stream_options or {}
    return Prepared(rid, chat, ids, params, bool(body.stream), bool(options.get("include_usage")), int(time.time()))


def output_problem(out: EngineOutput) -> HTTPProblem:
    """The HTTP error of an engine error output: 400 when a field is at fault, else 500."""
    return HTTPProblem(400 if out.error_field else 500, out.error or "failed", out.error_field)


def response_body(p: Prepared, out: EngineOutput, model_name: str) -> dict[str, Any]:
    """The non-streamed response body of finished ``out``."""
    return openai_body(out, p.chat, model_name, p.request_id.split("-", 1)[1], p.created).model_dump()


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream_events(p: Prepared, outputs: AsyncIterator[EngineOutput], model_name: str) -> AsyncIterator[str]:
    """The SSE events of one streamed request, from its engine outputs (outputs so far, then the final
    one): per sample (``index`` i of n) its text deltas with, when asked, the logprobs of the tokens
    generated since its last chunk, then its finish reason; the usage chunk (every sample's tokens)
    with ``include_usage``; ``[DONE]``. An error output becomes an error event (OpenAI's error
    object) before ``[DONE]``."""
    n = p.params.n
    sent_text, sent_tokens, done = [""] * n, [0] * n, [False] * n
    cls = ChatCompletionStreamResponse if p.chat else CompletionStreamResponse

    def chunk(index: int, text: str | None, finish: str | None, positions: list | None = None,
              role: bool = False) -> str:
        if p.chat:
            delta = DeltaMessage(role="assistant", content="") if role else DeltaMessage(content=text)
            lp: Any = None if positions is None else chat_logprobs(positions)
            choice: Any = ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)
        else:
            lp = None if positions is None else completion_logprobs(positions, len(sent_text[index]))
            choice = CompletionStreamChoice(index=index, text=text or "", finish_reason=finish, logprobs=lp)
        return sse(cls(id=p.request_id, created=p.created, model=model_name, choices=[choice]).model_dump())

    if p.chat:
        for i in range(n):
            yield chunk(i, None, None, role=True)
    async for out in outputs:
        if out.error is not None:
            yield sse(output_problem(out).body())
            break
        for o in out.outputs:
            i = o.index
            if done[i]:
                continue
            finished = out.finished or o.finish_reason is not None
            delta = o.text[len(sent_text[i]):]
            positions = None if o.logprobs is None else o.logprobs[sent_tokens[i]:]
            if delta or finished or positions:
                yield chunk(i, delta, o.finish_reason if finished else None, positions)
            sent_text[i], sent_tokens[i], done[i] = o.text, len(o.token_ids), finished
        if out.finished:
            if p.include_usage:
                yield sse(cls(id=p.request_id, created=p.created, model=model_name, choices=[],
                              usage=usage_info(out)).model_dump())
            break
    yield sse("[DONE]")
