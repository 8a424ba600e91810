"""Parse and validate a JSONL request file before the model loads; tokenize requests.

One JSON object per line, UTF-8 with or without a leading BOM (blank lines are skipped, line
numbers stay physical, 1-based). The shapes are the models of :mod:`tpengine.protocol.requests`:

* simple (:class:`~tpengine.protocol.SimpleRequest`): ``{"id"?, "prompt": str}`` |
  ``{"id"?, "messages": [{"role", "content"}, ...]}`` | ``{"id"?, "prompt_token_ids": [int, ...]}``,
  plus the optional sampling fields under vLLM's ``SamplingParams`` names (``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``ignore_eos``, ``n``,
  ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``min_tokens``,
  ``logit_bias``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``logprobs``, ``prompt_logprobs``), the chat-template options with ``messages``
  (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) and
  ``stream`` (false only). A line without ``id`` gets its 0-based line number as id.
* OpenAI Batch API (:class:`~tpengine.protocol.BatchRequestLine`): ``{"custom_id", "method":
  "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}``; body ``messages``
  (chat) or ``prompt`` (completions: one prompt a line), ``max_tokens`` / ``max_completion_tokens``,
  the sampling fields in OpenAI's names (``n``, ``logprobs``, ``top_logprobs``, ...) and vLLM's
  extra fields, the chat-template options (chat); ``model``, ``user``, ``stream`` (false only),
  ``stream_options``, ``metadata``, ``store`` are ignored.

``null`` for an optional field means "not given". ``max_tokens`` is the line's value, else the
caller's default (CLI flags, then the config ``[sampling]`` table, then the model's
generation_config.json ``max_new_tokens``), else the format's: None for a chat body (until EOS or
the context limit, as OpenAI and vLLM), 16 for the others.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tpengine.frontend.tools import ToolUse, tool_use
from tpengine.protocol.errors import field_errors
from tpengine.protocol.requests import FORMAT_BY_URL, BatchRequestLine, SimpleRequest
from tpengine.sampling_params import SamplingParams

#: The error of a batch chat line with tools whose ``tool_choice`` is "auto" (also the default).
BATCH_AUTO_TOOLS = ('tool_choice "auto" (the default with tools) needs a tool-call parser, which the batch job '
                    'does not have; use "required", a named function ({"type": "function", "function": {"name": '
                    '...}}) or "none"')
#: ``max_tokens`` when neither the line nor the caller's defaults set it, by request format.
DEFAULT_MAX_TOKENS: dict[str, int | None] = {"simple": 16, "openai_completion": 16, "openai_chat": None}


@dataclass
class ParsedRequest:
    """One valid request line.

    ``kind``: "prompt" (payload str) | "messages" (payload list of {"role", "content"} dicts) |
    "token_ids" (payload list[int]); ``format``: "simple" | "openai_chat" | "openai_completion"
    (decides the output record shape); ``line``: 1-based line number; ``model``: the OpenAI
    body's model name as given, else None (records name the served model, not this one);
    ``template_options``: for "messages", the ``apply_chat_template`` keyword arguments
    (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``; see
    :meth:`tpengine.protocol.messages.ChatTemplateFields.template_options`), None: the defaults;
    ``echo``: a completions body's ``echo`` (its record starts with the prompt, :class:`EchoPrompt`);
    ``tools``: a chat body's ``required`` or named ``tool_choice`` (its record's ``tool_calls``; the
    constraint is in ``params``).
    """

    id: str
    line: int
    kind: str
    format: str
    payload: Any
    params: SamplingParams
    model: str | None = None
    template_options: dict[str, Any] | None = None
    echo: bool = False
    tools: ToolUse | None = None


@dataclass(frozen=True)
class EchoPrompt:
    """What a completions request's ``echo`` puts before its completion: the prompt's ``text`` (as
    given, or the decoded ids of a token-id prompt, as vLLM) and, when logprobs are asked, the text
    of each prompt token (``tokenizer.decode([id])``, as the engine names logprob tokens) and
    ``logprobs``, the number of top tokens per position."""

    text: str
    tokens: list[str] | None = None
    logprobs: int | None = None

    @property
    def offset(self) -> int:
        """The ``text_offset`` of the first generated token: the prompt tokens' texts summed, as
        vLLM counts them (the prompt's length when they are not known)."""
        return len(self.text) if self.tokens is None else sum(map(len, self.tokens))


def echo_prompt(kind: str, payload: Any, ids: list[int], params: SamplingParams, tokenizer) -> EchoPrompt:
    """The :class:`EchoPrompt` of a prompt of ``kind`` ("prompt" | "token_ids") tokenized to ``ids``."""
    text = payload if kind == "prompt" else tokenizer.decode(ids)
    tokens = None if params.logprobs is None else tokenizer.batch_decode([[t] for t in ids])
    return EchoPrompt(text, tokens, params.logprobs)


@dataclass
class RequestError:
    """One problem with one line: 1-based ``line``, the request ``id`` when known, the
    ``field`` (e.g. "max_tokens", "body.messages[0].role", None for the line as a whole)."""

    line: int
    id: str | None
    field: str | None
    message: str
    format: str = "simple"

    def __str__(self) -> str:
        where = f"line {self.line}" + (f" (id {self.id!r})" if self.id is not None else "")
        return f"{where}: " + (f"field {self.field!r}: " if self.field else "") + self.message


class RequestValidationError(ValueError):
    """A request that cannot run; ``field`` names the offending field (or None)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def iter_requests(
    lines: Iterable[str | bytes], defaults: Mapping[str, Any] | None = None
) -> Iterator[tuple[int, ParsedRequest | None, list[RequestError]]]:
    """Validate ``lines`` one at a time: yield ``(line, request, errors)`` for every non-blank line
    (1-based physical line numbers; a line's trailing ``"\n"`` is dropped, a BOM is removed from
    the first line only). ``request`` is None when ``errors`` is not empty (one RequestError per
    problem: unknown field, wrong type, out-of-range value, duplicate id, bad JSON).

    ``defaults``: SamplingParams kwargs for fields a line leaves out. Only the dict of ids seen
    so far (id -> line) is kept between lines, so a file of any length streams through.
    """
    seen: dict[str, int] = {}
    for idx, raw in enumerate(lines):
        parsed = _parse_line(idx, raw, defaults or {}, seen)
        if parsed is not None:
            yield parsed


def parse_lines(
    lines: Iterable[str | bytes], defaults: Mapping[str, Any] | None = None
) -> tuple[list[ParsedRequest], list[RequestError]]:
    """Validate every line (:func:`iter_requests`, collected). ``defaults``: SamplingParams kwargs
    for fields a line leaves out. Returns (requests, errors); a line with any error yields no
    request, and one RequestError per problem."""
    requests: list[ParsedRequest] = []
    errors: list[RequestError] = []
    for _line, req, errs in iter_requests(lines, defaults):
        if req is not None:
            requests.append(req)
        errors.extend(errs)
    return requests, errors


def parse_requests(
    path: str | os.PathLike, defaults: Mapping[str, Any] | None = None
) -> tuple[list[ParsedRequest], list[RequestError]]:
    """``parse_lines`` over the file at ``path``, read line by line. Raises FileNotFoundError / OSError."""
    with open(path, "rb") as fh:
        return parse_lines(fh, defaults)


def _parse_line(
    idx: int, raw: str | bytes, defaults: Mapping[str, Any], seen: dict[str, int]
) -> tuple[int, ParsedRequest | None, list[RequestError]] | None:
    """One line (0-based ``idx``): None when blank, else (line, request or None, errors)."""
    lineno = idx + 1
    problems: list[tuple[str | None, str]] = []
    fmt, rid, obj = "simple", None, None
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        text = text.removesuffix("\n")
        if idx == 0:
            text = text.removeprefix("\ufeff")  # a UTF-8 BOM ("utf-8-sig" files)
        if not text.strip():
            return None
        obj = json.loads(text)
        if not isinstance(obj, dict):
            problems.append((None, "must be a JSON object"))
    except UnicodeDecodeError as e:
        problems.append((None, f"not UTF-8: {e}"))
    except json.JSONDecodeError as e:
        problems.append((None, f"invalid JSON: {e.msg} at column {e.colno}"))
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        problems.append((None, f"invalid JSON: {e}"))
    except RecursionError:
        problems.append((None, "invalid JSON: nested too deeply"))
    model: SimpleRequest | BatchRequestLine | None = None
    if isinstance(obj, dict):
        batch = BatchRequestLine.is_batch_line(obj)
        if batch:
            fmt = FORMAT_BY_URL.get(obj.get("url"), "openai_chat")
            rid = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) and obj["custom_id"] else None
        else:
            rid = obj.get("id")
            rid = str(idx) if rid is None else str(rid) if _is_id(rid) else None
        try:
            model = (BatchRequestLine if batch else SimpleRequest).model_validate(obj)
        except ValidationError as e:
            problems.extend(field_errors(e))
    if rid is not None:
        if rid in seen:
            problems.append(("custom_id" if fmt != "simple" else "id",
                             f"duplicate id {rid!r} (first on line {seen[rid]})"))
        else:
            seen[rid] = lineno
    req = None
    if not problems and model is not None:
        body, name = (model.body, model.body.model) if isinstance(model, BatchRequestLine) else (model, None)
        kind, payload = body.prompt_payload()
        tools, constraint = None, None
        if fmt == "openai_chat":
            try:  # the batch job has no tool-call parser: "required" and named choices only
                tools, constraint = tool_use(body, None, False)
            except ValueError:
                problems.append(("body.tool_choice", BATCH_AUTO_TOOLS))
        try:
            params = make_params(fmt, defaults, body.sampling_kwargs())
            if constraint is not None:
                params = dataclasses.replace(params, structured_outputs=constraint)
        except (TypeError, ValueError) as e:
            problems.append((None, f"invalid sampling parameters: {e}"))
        if not problems:
            req = ParsedRequest(rid, lineno, kind, fmt, payload, params, name, template_options(body, kind),
                                bool(getattr(body, "echo", False)), tools)
    return lineno, req, [RequestError(lineno, rid, f, m, fmt) for f, m in problems]


def make_params(fmt: str, defaults: Mapping[str, Any], request: Mapping[str, Any]) -> SamplingParams:
    """The SamplingParams of one request of format ``fmt``: the request's fields over ``defaults``
    (the caller's: CLI flags, ``[sampling]`` table, generation_config.json) over the built-in
    ones (``max_tokens`` :data:`DEFAULT_MAX_TOKENS` of ``fmt``).

    Raises:
        ValueError: an invalid combination (from SamplingParams, e.g. ``min_tokens`` > the
            default ``max_tokens``), naming the fields.
    """
    return SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS[fmt], **defaults, **request})


def template_options(body: Any, kind: str) -> dict[str, Any] | None:
    """The chat-template options of a validated request model with a "messages" prompt (None for
    other prompts, or a model without the options)."""
    fn = getattr(body, "template_options", None)
    return fn() if kind == "messages" and fn is not None else None


def _is_id(v: Any) -> bool:
    """A valid simple-line id: a non-empty string or an integer (not a bool)."""
    return (isinstance(v, str) and v != "") or (isinstance(v, int) and not isinstance(v, bool))


def to_token_ids(req: ParsedRequest, tokenizer, vocab_size: int | None = None) -> list[int]:
    """Prompt ids for ``req``: a prompt gets the tokenizer's default special tokens once; messages
    are exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=...,
    continue_final_message=..., tokenize=True, **chat_template_kwargs)`` with ``req.template_options``
    (default: ``add_generation_prompt`` true; never a second BOS); token ids are taken as given.

    Raises:
        RequestValidationError: a token id >= ``vocab_size`` (default ``len(tokenizer)``; names
            the id and the vocab size), no chat template, or an empty result.
    """
    if req.kind == "prompt":
        ids = list(tokenizer(req.payload)["input_ids"])
        field = _field(req, "prompt")
    elif req.kind == "messages":
        field = _field(req, "messages")
        try:
            opts = dict(req.template_options or {})
            kwargs = opts.pop("chat_template_kwargs", None) or {}
            out = tokenizer.apply_chat_template(req.payload, **{**kwargs, "add_generation_prompt": True, **opts,
                                                                "tokenize": True})
        except ValueError as e:  # e.g. the tokenizer has no chat template
            raise RequestValidationError(f"cannot apply the chat template: {e}", field) from e
        ids = list(out["input_ids"] if isinstance(out, Mapping) else out)
    else:
        ids = list(req.payload)
        field = _field(req, "prompt" if req.format != "simple" else "prompt_token_ids")
        size = len(tokenizer) if vocab_size is None else vocab_size
        for t in ids:
            if t >= size:
                raise RequestValidationError(f"token id {t} is out of range: vocab size is {size}", field)
    if not ids:
        raise RequestValidationError("the prompt has no tokens", field)
    return ids


def failure_message(req: ParsedRequest, exc: Exception) -> str:
    """What to tell the user when templating or tokenizing ``req`` raised ``exc``: ``"<stage> failed:
    <Exception>: <message>"``, saying first where the text holds an unpaired UTF-16 surrogate (JSON
    allows ``"\\ud800"``, but it is not Unicode text, and tokenizers refuse it)."""
    stage = "applying the chat template" if req.kind == "messages" else "tokenizing"
    texts = [req.payload] if req.kind == "prompt" else [
        m.get("content") for m in req.payload if isinstance(m, Mapping)] if req.kind == "messages" else []
    for text in texts:
        if isinstance(text, str) and (i := next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF),
                                                None)) is not None:
            return (f"{stage} failed: the text holds an unpaired surrogate U+{ord(text[i]):04X} at character {i}, "
                    f"which is not Unicode text ({type(exc).__name__}: {exc})")
    return f"{stage} failed: {type(exc).__name__}: {exc}"


def _field(req: ParsedRequest, name: str) -> str:
    return name if req.format == "simple" else "body." + name
