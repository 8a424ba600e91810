"""Parse and validate a JSONL request file before the model loads; tokenize requests.

One JSON object per line, UTF-8 with or without a leading BOM (blank lines are skipped, line
numbers stay physical, 1-based):

* simple: ``{"id"?, "prompt": str}`` | ``{"id"?, "messages": [{"role", "content"}, ...]}`` |
  ``{"id"?, "prompt_token_ids": [int, ...]}``, plus optional ``max_tokens``, ``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop`` (string or list), ``ignore_eos``,
  ``stream`` (accepted, ignored). A line without ``id`` gets its 0-based line number as id.
* OpenAI Batch API: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions", "body": {...}}``; body ``messages`` (chat) or ``prompt`` (completions),
  ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``top_k``, ``min_p``, ``ignore_eos``, ``n`` (1 only); ``model``, ``user``, ``stream``,
  ``stream_options``, ``metadata``, ``store`` are ignored.

``null`` for an optional field means "not given". Missing sampling fields take the caller's
defaults (config ``[sampling]`` table, then CLI flags).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tpengine.engine.sampling_params import SamplingParams
from tpengine.frontend._fields import (
    BATCH_FIELDS,
    SIMPLE_FIELDS,
    Checker,
    is_int,
    parse_batch,
    parse_prompt,
    parse_sampling,
)


@dataclass
class ParsedRequest:
    """One valid request line.

    ``kind``: "prompt" (payload str) | "messages" (payload list of {"role", "content"} dicts) |
    "token_ids" (payload list[int]); ``format``: "simple" | "openai_chat" | "openai_completion"
    (decides the output record shape); ``line``: 1-based line number; ``model``: the OpenAI
    body's model name (echoed in the output), else None.
    """

    id: str
    line: int
    kind: str
    format: str
    payload: Any
    params: SamplingParams
    model: str | None = None


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


def parse_lines(
    lines: Iterable[str | bytes], defaults: Mapping[str, Any] | None = None
) -> tuple[list[ParsedRequest], list[RequestError]]:
    """Validate every line. ``defaults``: SamplingParams kwargs for fields a line leaves out.

    Returns (requests, errors); a line with any error yields no request, and one RequestError
    per problem (unknown field, wrong type, out-of-range value, duplicate id, bad JSON).
    """
    requests: list[ParsedRequest] = []
    errors: list[RequestError] = []
    seen: dict[str, int] = {}
    for idx, raw in enumerate(lines):
        lineno = idx + 1
        c = Checker()
        fmt, rid, obj = "simple", None, None
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            if idx == 0:
                text = text.removeprefix("\ufeff")  # a UTF-8 BOM ("utf-8-sig" files)
            if not text.strip():
                continue
            obj = json.loads(text)
            if not isinstance(obj, dict):
                c.bad(None, "must be a JSON object")
        except UnicodeDecodeError as e:
            c.bad(None, f"not UTF-8: {e}")
        except json.JSONDecodeError as e:
            c.bad(None, f"invalid JSON: {e.msg} at column {e.colno}")
        if isinstance(obj, dict) and any(k in obj for k in BATCH_FIELDS):
            rid, bfmt, prompt, kw, model = parse_batch(obj, c)
            fmt = bfmt or "openai_chat"
        elif isinstance(obj, dict):
            c.unknown(obj, SIMPLE_FIELDS)
            rid = obj.get("id")
            if rid is None:
                rid = str(idx)
            elif is_int(rid):
                rid = str(rid)
            elif not isinstance(rid, str) or not rid:
                c.bad("id", "must be a non-empty string or an integer")
                rid = None
            prompt = parse_prompt(obj, c, ("prompt", "messages", "prompt_token_ids"))
            kw, model = parse_sampling(obj, c), None
        c.prefix = ""
        if rid is not None:
            if rid in seen:
                name = "custom_id" if fmt != "simple" else "id"
                c.bad(name, f"duplicate id {rid!r} (first on line {seen[rid]})")
            else:
                seen[rid] = lineno
        if not c.errors:
            try:
                params = SamplingParams(**{**(defaults or {}), **kw})
            except (TypeError, ValueError) as e:
                c.bad(None, f"invalid sampling parameters: {e}")
        if c.errors:
            errors.extend(RequestError(lineno, rid, f, m, fmt) for f, m in c.errors)
            continue
        requests.append(ParsedRequest(rid, lineno, prompt[0], fmt, prompt[1], params, model))
    return requests, errors


def parse_requests(
    path: str | os.PathLike, defaults: Mapping[str, Any] | None = None
) -> tuple[list[ParsedRequest], list[RequestError]]:
    """``parse_lines`` over the file at ``path``. Raises FileNotFoundError / OSError."""
    with open(path, "rb") as fh:
        return parse_lines(fh.read().split(b"\n"), defaults)


def to_token_ids(req: ParsedRequest, tokenizer, vocab_size: int | None = None) -> list[int]:
    """Prompt ids for ``req``: a prompt gets the tokenizer's default special tokens once; messages
    are exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`` (never a second BOS); token ids are taken as given.

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
            out = tokenizer.apply_chat_template(req.payload, add_generation_prompt=True, tokenize=True)
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


def _field(req: ParsedRequest, name: str) -> str:
    return name if req.format == "simple" else "body." + name
