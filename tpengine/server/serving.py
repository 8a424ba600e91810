"""One OpenAI request on the server: parse and tokenize it (through the same protocol layer and
tokenizing code as the batch job), and turn the engine's outputs into a response body or SSE chunks."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from tpengine.engine.outputs import CompletionOutput, EngineOutput, PositionLogprobs
from tpengine.frontend.logprobs import chat_logprobs
from tpengine.frontend.output import completion_body, completion_text, openai_body, usage_info
from tpengine.frontend.reasoning import REASONING_PARSERS, ReasoningParser, thought_tags
from tpengine.frontend.requests import (
    EchoPrompt,
    ParsedRequest,
    RequestValidationError,
    echo_prompt,
    failure_message,
    make_params,
    template_options,
    to_token_ids,
)
from tpengine.frontend.tools import ToolUse, new_call_id, tool_use
from tpengine.protocol import ChatCompletionRequest, CompletionRequest
from tpengine.protocol.base import IGNORE_UNKNOWN, ProtocolModel
from tpengine.protocol.errors import field_errors
from tpengine.protocol.records import (
    DetokenizeResponse,
    FunctionCallOut,
    PromptTokensDetails,
    TokenizeResponse,
    UsageInfo,
)
from tpengine.protocol.requests import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from tpengine.protocol.stream import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
)
from tpengine.sampling_params import SamplingParams

FORMATS = {"chat": "openai_chat", "completion": "openai_completion"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               503: "service_unavailable", 500: "server_error"}


class HTTPProblem(Exception):
    """A request the server answers with an error: HTTP ``status``, the ``param`` at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        default = "invalid_request_error" if self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, default),
                         param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


@dataclass
class Prepared:
    """A request ready for the engine: its id, format, params, streaming options, and its prompts
    (one for chat; one or more for completions, each an engine request of its own: ``prompt_ids``,
    and ``echoes`` when the body asked for ``echo``)."""

    request_id: str
    chat: bool
    prompt_ids: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int
    echoes: list[EchoPrompt | None]
    structured_field: str | None = None  # the body field of its output constraint, if any
    tools: ToolUse | None = None  # how a chat output becomes tool calls, when the request has tools
    reasoning: ReasoningParser | None = None  # a chat output's reasoning split, with --reasoning-parser
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage per chunk
    token_id_strings: bool = False  # return_tokens_as_token_ids: logprobs tokens as "token_id:<id>"

    def engine_ids(self) -> list[str]:
        """The engine request id of each prompt: the request's own id, with ``-<prompt>`` when
        there are several."""
        if len(self.prompt_ids) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompt_ids))]


def validate_body(model: type[ProtocolModel], obj: Any) -> Any:
    """``obj`` validated as ``model`` in lenient mode: unknown fields (at any depth) are dropped and
    logged once per field name for this process, as vLLM's server does; a known field with a bad
    value stays an error.

    Raises:
        HTTPProblem: 400 for a body that is not a JSON object or not valid, naming the field.
    """
    if not isinstance(obj, dict):
        raise HTTPProblem(400, "the request body must be a JSON object")
    found: set[tuple[str, str]] = set()
    try:
        body = model.model_validate(obj, context={IGNORE_UNKNOWN: found})
    except ValidationError as e:
        errs = field_errors(e)
        raise HTTPProblem(400, "; ".join((f"{f}: " if f else "") + m for f, m in errs), errs[0][0]) from None
    finally:
        log_ignored(found, _LOGGED)
    return body


_LOGGED: set[tuple[str, str]] = set()  # (model, field) names the server has said it ignores


def log_ignored(found: set[tuple[str, str]], logged: set[tuple[str, str]]) -> None:
    """Say on stderr, once per (model, field) in ``logged``, that an unknown field was ignored."""
    for where, name in sorted(found - logged):
        logged.add((where, name))
        print(f"[tpengine rank 0] ignoring the unknown field {name!r} of {where} (tpengine does not use it); "
              "said once per field", file=sys.stderr, flush=True)


def check_model(asked: str | None, model_name: str) -> None:
    """A body's ``model``, when given, must be the served one. Raises HTTPProblem (404)."""
    if asked is not None and asked != model_name:
        raise HTTPProblem(404, f"The model `{asked}` does not exist; this server serves `{model_name}`", "model")


def check_length(n_prompt: int, max_tokens: int | None, max_model_len: int, field: str, tokens_field: str) -> None:
    """vLLM's length rule: a prompt that leaves no room for one output token, or, when the body sets
    ``max_tokens``, prompt + ``max_tokens`` beyond ``max_model_len``, is a 400 naming the numbers.

    Raises:
        HTTPProblem: 400 with ``param`` ``field`` (the prompt) or ``tokens_field``.
    """
    if n_prompt >= max_model_len:
        raise HTTPProblem(400, f"the prompt has {n_prompt} tokens, but max_model_len is {max_model_len} (the "
                          f"prompt must be at most {max_model_len - 1} tokens to leave room for one output "
                          "token)", field)
    if max_tokens is not None and n_prompt + max_tokens > max_model_len:
        raise HTTPProblem(400, f"this model's maximum context length (max_model_len) is {max_model_len} tokens, "
                          f"but the request asks for {n_prompt + max_tokens}: {n_prompt} in the prompt and "
                          f"{max_tokens} in the completion ({tokens_field}); ask for at most "
                          f"{max_model_len - n_prompt} tokens, or shorten the prompt", tokens_field)


def prepare_request(obj: Any, kind: str, tokenizer, vocab_size: int, max_model_len: int, model_name: str,
                    defaults: Mapping[str, Any], tool_parser: str | None = None,
                    enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
                    base_id: str | None = None) -> Prepared:
    """Validate an OpenAI request body (``kind`` "chat" or "completion", :func:`validate_body`) and
    tokenize its prompt(s). A chat body's tools (:func:`tpengine.frontend.tools.tool_use`): "auto"
    reads calls with ``tool_parser`` (needs ``enable_auto_tool_choice``); "required" and a named
    choice add their output constraint to the params. ``reasoning_parser``: a chat output's thought
    is split off (:mod:`tpengine.frontend.reasoning`: whether the output starts inside a thought, from
    the prompt and ``chat_template_kwargs``), and ``params.thinking`` says the same to the engine, so its
    output constraint starts where the split puts the content.
    ``base_id``: the request's id (its ``x-request-id``; default a new uuid4), which the response's
    ``id`` and the engine request's id carry as ``chatcmpl-<id>`` / ``cmpl-<id>``, as vLLM's.

    Raises:
        HTTPProblem: 400 for a body that is not valid (naming the field, as the batch job does), a
            prompt the tokenizer or chat template refuses, or one too long (:func:`check_length`),
            ``tool_choice`` "auto" without a parser; 404 for a ``model`` other than ``model_name``.
    """
    chat = kind == "chat"
    body = validate_body(ChatCompletionRequest if chat else CompletionRequest, obj)
    check_model(body.model, model_name)
    if body.stream and body.prompt_logprobs is not None:  # vLLM refuses it too
        raise HTTPProblem(400, "prompt_logprobs are not available when stream is true; ask without streaming",
                          "prompt_logprobs")
    fmt = FORMATS[kind]
    try:
        params = make_params(fmt, defaults, body.sampling_kwargs())
    except (TypeError, ValueError) as e:
        raise HTTPProblem(400, f"invalid sampling parameters: {e}") from None
    tools, structured_field = None, body.structured_field
    if chat:
        try:
            tools, constraint = tool_use(body, tool_parser, enable_auto_tool_choice)
        except ValueError as e:
            raise HTTPProblem(400, str(e), "tool_choice") from None
        if constraint is not None:
            params, structured_field = replace(params, structured_outputs=constraint), "tool_choice"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{base_id or uuid.uuid4().hex}"
    field = "messages" if chat else "prompt"
    tokens_field = next((k for k in ("max_completion_tokens", "max_tokens") if getattr(body, k) is not None),
                        "max_tokens")
    echo = bool(getattr(body, "echo", False))
    payloads = [body.prompt_payload()] if chat else body.prompt_payloads()
    prompt_ids, echoes = [], []
    for payload_kind, payload in payloads:
        req = ParsedRequest(rid, 0, payload_kind, fmt, payload, params, body.model,
                            template_options(body, payload_kind), echo)
        try:
            ids = to_token_ids(req, tokenizer, vocab_size)
            echoes.append(echo_prompt(payload_kind, payload, ids, params, tokenizer) if echo else None)
        except RequestValidationError as e:
            raise HTTPProblem(400, str(e), (e.field or field).removeprefix("body.")) from None
        except Exception as e:  # noqa: BLE001 -- the template's raise_exception, a lone surrogate: this request's
            raise HTTPProblem(400, failure_message(req, e), field) from None
        check_length(len(ids), getattr(body, tokens_field), max_model_len, field, tokens_field)
        prompt_ids.append(ids)
    as_ids = bool(body.return_tokens_as_token_ids)
    if as_ids and echo:  # the echoed prompt's tokens are named by id too, as vLLM
        echoes = [e if e is None or e.tokens is None else replace(e, tokens=[token_id_string(t) for t in ids])
                  for e, ids in zip(echoes, prompt_ids)]
    reasoning = None
    if chat and reasoning_parser is not None:  # where the thought ends: this split's and the grammar's decision
        kwargs = (template_options(body, "messages") or {}).get("chat_template_kwargs")
        reasoning = REASONING_PARSERS[reasoning_parser].for_request(
            thought_tags(reasoning_parser, tokenizer), tokenizer, prompt_ids[0], kwargs, params.skip_special_tokens)
        params = replace(params, thinking=reasoning.thinking)
    options = body.stream_options or {}
    usage = bool(options.get("include_usage"))
    return Prepared(rid, chat, prompt_ids, params, bool(body.stream), usage, int(time.time()), echoes,
                    structured_field, tools, reasoning, usage and bool(options.get("continuous_usage_stats")), as_ids)


def token_id_string(token_id: int) -> str:
    """vLLM's name of a token under ``return_tokens_as_token_ids``: ``"token_id:<id>"``."""
    return f"token_id:{token_id}"


def _named_by_id(positions: list | None) -> list | None:
    """``positions`` (logprobs, None entries kept) with every token's text ``"token_id:<id>"``."""
    if positions is None:
        return None
    return [None if p is None else PositionLogprobs(
        replace(p.chosen, token=token_id_string(p.chosen.token_id)),
        [replace(t, token=token_id_string(t.token_id)) for t in p.top]) for p in positions]


def tokens_as_ids(out: EngineOutput) -> EngineOutput:
    """``out`` with the tokens of its logprobs and prompt logprobs named ``"token_id:<id>"`` (vLLM's
    ``return_tokens_as_token_ids``: a client can map each back to its id even where a token's text
    is not valid UTF-8 on its own); ``out`` itself is unchanged."""
    if out.prompt_logprobs is None and all(o.logprobs is None for o in out.outputs):
        return out
    return replace(out, prompt_logprobs=_named_by_id(out.prompt_logprobs),
                   outputs=[replace(o, logprobs=_named_by_id(o.logprobs)) for o in out.outputs])


def tokenize_body(obj: Any, tokenizer, vocab_size: int, max_model_len: int, model_name: str) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a ``prompt`` or ``messages`` body (lenient, :func:`validate_body`),
    tokenized exactly as the completions or chat endpoint tokenizes it (``add_special_tokens``
    false leaves the tokenizer's special tokens off a prompt).

    Raises:
        HTTPProblem: 400 for an invalid body or a conversation the chat template refuses; 404 for
            another ``model``.
    """
    chat = isinstance(obj, dict) and "messages" in obj
    body = validate_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, obj)
    check_model(body.model, model_name)
    if chat:
        req = ParsedRequest("tokenize", 0, "messages", "openai_chat", [m.to_template() for m in body.messages],
                            SamplingParams(), body.model, body.template_options())
        try:
            ids = to_token_ids(req, tokenizer, vocab_size)
        except RequestValidationError as e:
            raise HTTPProblem(400, str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 -- the template's raise_exception: this request's
            raise HTTPProblem(400, failure_message(req, e), "messages") from None
    else:
        add = body.add_special_tokens is not False
        try:
            ids = list(tokenizer(body.prompt, add_special_tokens=add)["input_ids"]) if body.prompt else []
        except Exception as e:  # noqa: BLE001 -- e.g. a lone surrogate: this request's
            req = ParsedRequest("tokenize", 0, "prompt", "openai_completion", body.prompt, SamplingParams())
            raise HTTPProblem(400, failure_message(req, e), "prompt") from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs).model_dump()


def tokenizer_info_body(tokenizer, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` (what lm-eval's remote tokenizer reads): the tokenizer's class, its
    special tokens, its chat template and ``model_max_length`` (the server's ``max_model_len``)."""
    def text(tok: Any) -> str | None:
        return None if tok is None else str(tok)

    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": text(tokenizer.eos_token),
            "bos_token": text(tokenizer.bos_token), "pad_token": text(tokenizer.pad_token),
            "unk_token": text(tokenizer.unk_token), "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": max_model_len, "vocab_size": len(tokenizer)}


def detokenize_body(obj: Any, tokenizer, vocab_size: int, model_name: str) -> dict[str, Any]:
    """vLLM's ``/detokenize``: the text of ``tokens`` (``tokenizer.decode``, special tokens kept).

    Raises:
        HTTPProblem: 400 for an invalid body or a token id outside the vocabulary; 404 for another
            ``model``.
    """
    body = validate_body(DetokenizeRequest, obj)
    check_model(body.model, model_name)
    if (bad := next((t for t in body.tokens if t >= vocab_size), None)) is not None:
        raise HTTPProblem(400, f"token id {bad} is out of range: vocab size is {vocab_size}", "tokens")
    try:
        text = tokenizer.decode(body.tokens)
    except Exception as e:  # noqa: BLE001 -- an id the tokenizer has no text for: this request's
        raise HTTPProblem(400, f"detokenizing failed: {type(e).__name__}: {e}", "tokens") from None
    return DetokenizeResponse(prompt=text).model_dump()


def output_problem(out: EngineOutput) -> HTTPProblem:
    """The HTTP error of an engine error output: 400 when a field is at fault, else 500."""
    return HTTPProblem(400 if out.error_field else 500, out.error or "failed", out.error_field)


def response_body(p: Prepared, outs: list[EngineOutput], model_name: str) -> dict[str, Any]:
    """The non-streamed response body of the finished outputs of ``p``'s prompts (in order)."""
    suffix = p.request_id.split("-", 1)[1]
    if p.token_id_strings:
        outs = [tokens_as_ids(o) for o in outs]
    if p.chat:
        return openai_body(outs[0], True, model_name, suffix, p.created, tools=p.tools,
                           reasoning=p.reasoning).model_dump()
    return completion_body(outs, p.echoes, model_name, suffix, p.created, p.params.n).model_dump()


def _chat_delta(text: str, sent: str, finished: bool, reason: str | None, tools: ToolUse | None
                ) -> tuple[str, list[DeltaToolCall] | None, str | None]:
    """One chat choice's next (content delta, tool-call deltas, finish reason), given its text so
    far and the content ``sent`` already. With ``tools``, text that may be a call is held back
    until the output ends; then its calls go out whole, each in one delta, and the reason becomes
    "tool_calls" (a held text that is no call goes out as content)."""
    if tools is None:
        return text[len(sent):], None, reason
    if not finished:
        visible = text[: tools.content_end(text)]
        return visible[len(sent):], None, reason
    content, calls = tools.extract(text)
    if not calls:
        return text[len(sent):], None, reason
    deltas = [DeltaToolCall(index=j, id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
              for j, c in enumerate(calls)]
    return (content or "")[len(sent):], deltas, "tool_calls"


def _chat_choice(p: Prepared, index: int, o: CompletionOutput, finished: bool, reason: str | None,
                 positions: list[PositionLogprobs] | None, sent_text: str, sent_thought: str
                 ) -> tuple[ChatCompletionStreamChoice | None, str, str]:
    """One streamed chat choice's next chunk from its output ``o`` so far: the thought split off
    (``p.reasoning``), the content (held back while it may be a tool call, :func:`_chat_delta`) and
    the logprobs of ``positions``, the tokens since its last chunk. ``sent_text`` / ``sent_thought``:
    the content and thought already sent. Returns (the choice at ``index``, or None when there is
    nothing to send; the thought delta; the content delta), the deltas to add to what was sent."""
    lp: Any = None if positions is None else chat_logprobs(positions)
    thought, text = (None, o.text) if p.reasoning is None else p.reasoning.split(o.text, o.token_ids, finished)
    thought_delta = (thought or "")[len(sent_thought):]
    delta, calls, reason = _chat_delta(text or "", sent_text, finished, reason, p.tools)
    if not (delta or thought_delta or calls or finished or positions):
        return None, thought_delta, delta
    choice = ChatCompletionStreamChoice(
        index=index, delta=DeltaMessage(content=delta if delta or not (calls or thought_delta) else None,
                                        reasoning_content=thought_delta or None, tool_calls=calls),
        finish_reason=reason, logprobs=lp)
    return choice, thought_delta, delta


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream_events(p: Prepared, outputs: AsyncIterator[EngineOutput], model_name: str) -> AsyncIterator[str]:
    """The SSE events of one streamed request, from the engine outputs of its prompts (outputs so
    far, then each prompt's final one, prompts interleaved): per choice (``index`` = prompt * n +
    sample) its text deltas with, when asked, the logprobs of the tokens generated since its last
    chunk, then its finish reason; a chat choice's first chunk carries only ``role`` (OpenAI's
    shape); a completions choice with ``echo`` starts with its prompt. Then the usage chunk (every
    prompt's and sample's tokens) with ``include_usage``; ``[DONE]``. With ``continuous_usage_stats``
    (vLLM's) every choice chunk carries ``usage`` too: its prompt's tokens and the tokens its choice
    generated so far. An error output becomes an error event (OpenAI's error object) before ``[DONE]``."""
    n = p.params.n
    prompt_of = {rid: i for i, rid in enumerate(p.engine_ids())}
    choices = len(p.prompt_ids) * n
    sent_text, sent_tokens, done, echoed = [""] * choices, [0] * choices, [False] * choices, [False] * choices
    sent_thought = [""] * choices
    finals: dict[str, EngineOutput] = {}
    cls = ChatCompletionStreamResponse if p.chat else CompletionStreamResponse

    def event(choice: Any, out: EngineOutput | None = None, tokens: int = 0) -> str:
        """One chunk of ``choice``; with continuous usage stats, the usage of its prompt (``out``'s)
        and ``tokens`` generated so far."""
        usage = None
        if p.continuous_usage:
            prompt = len(p.prompt_ids[choice.index // n])
            usage = UsageInfo(prompt_tokens=prompt, completion_tokens=tokens, total_tokens=prompt + tokens,
                              prompt_tokens_details=PromptTokensDetails(
                                  cached_tokens=0 if out is None else out.num_cached_tokens))
        return sse(cls(id=p.request_id, created=p.created, model=model_name, choices=[choice],
                       usage=usage).model_dump())

    if p.chat:
        for i in range(n):
            yield event(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    async for out in outputs:
        if out.error is not None:
            yield sse(output_problem(out).body())
            break
        if p.token_id_strings:
            out = tokens_as_ids(out)
        prompt = prompt_of[out.request_id]
        for o in out.outputs:
            i = prompt * n + o.index
            if done[i]:
                continue
            finished = out.finished or o.finish_reason is not None
            delta = o.text[len(sent_text[i]):]
            positions = None if o.logprobs is None else o.logprobs[sent_tokens[i]:]
            echo = None if echoed[i] else p.echoes[prompt]
            if delta or finished or positions or echo is not None:
                reason = o.finish_reason if finished else None
                if p.chat:
                    choice, thought_delta, delta = _chat_choice(p, i, o, finished, reason, positions,
                                                                sent_text[i], sent_thought[i])
                    if choice is not None:
                        yield event(choice, out, len(o.token_ids))
                    sent_thought[i] += thought_delta
                    sent_text[i] += delta  # the content sent: text that may be a tool call is held back
                    sent_tokens[i], done[i] = len(o.token_ids), finished
                    continue
                # offsets count from the start of the whole text: the echoed prompt, then the completion
                # (completion_text adds the prompt's offset itself to the chunk that carries it)
                echoed_before = p.echoes[prompt] is not None and echo is None
                offset = len(sent_text[i]) + (p.echoes[prompt].offset if echoed_before else 0)
                text, lp = completion_text(o, echo, out.prompt_logprobs, delta, positions, offset)
                yield event(CompletionStreamChoice(index=i, text=text, finish_reason=reason, logprobs=lp), out,
                            len(o.token_ids))
                echoed[i] = True
            sent_text[i], sent_tokens[i], done[i] = o.text, len(o.token_ids), finished
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == len(prompt_of):
                if p.include_usage:
                    yield sse(cls(id=p.request_id, created=p.created, model=model_name, choices=[],
                                  usage=usage_info(*(finals[r] for r in p.engine_ids()))).model_dump())
                break
    yield sse("[DONE]")
