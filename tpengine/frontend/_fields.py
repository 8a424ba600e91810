"""Field-by-field validation of one request line (private helper of ``requests``).

Each helper records ``(field, message)`` problems on a ``Checker`` and returns the parsed value
(or None). Field names in messages carry the ``body.`` prefix inside OpenAI Batch lines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from tpengine.engine.sampling_params import SAMPLING_KEYS

SIMPLE_FIELDS = ("id", "prompt", "messages", "prompt_token_ids", *SAMPLING_KEYS, "stream")
BATCH_FIELDS = ("custom_id", "method", "url", "body")
BODY_IGNORED = ("model", "user", "stream", "stream_options", "metadata", "store")
# OpenAI fields tpengine does not implement, accepted only at their neutral values
BODY_NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (False, None),
                "top_logprobs": (None, 0), "logit_bias": (None, {}), "response_format": (None, {"type": "text"}),
                "echo": (False,), "best_of": (None, 1), "suffix": (None,)}
BODY_FIELDS = ("messages", "prompt", "max_completion_tokens", "n", *SAMPLING_KEYS, *BODY_IGNORED, *BODY_NEUTRAL)
URLS = {"/v1/chat/completions": "openai_chat", "/v1/completions": "openai_completion"}


class Checker:
    """Collects the (field, message) errors of one line; field names get ``prefix`` ("body.")."""

    def __init__(self) -> None:
        self.prefix = ""
        self.errors: list[tuple[str | None, str]] = []

    def bad(self, name: str | None, msg: str) -> None:
        self.errors.append((None if name is None else self.prefix + name, msg))

    def unknown(self, obj: Mapping, valid: Iterable[str], prefix: str = "") -> None:
        for k in obj:
            if k not in valid:
                msg = f"unknown field; valid: {', '.join(valid)}"
                self.errors.append((self.prefix + prefix + str(k), msg))


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """A finite int or float (not bool; JSON NaN/Infinity rejected)."""
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def parse_sampling(obj: Mapping, c: Checker, max_tokens_key: str = "max_tokens") -> dict[str, Any]:
    """Validate the sampling fields of ``obj``; return SamplingParams kwargs for those given."""
    out: dict[str, Any] = {}

    def num(name: str, ok, valid: str, want_int: bool = False) -> None:
        v = obj.get(name)
        if v is None:
            return
        if (is_int(v) if want_int else is_num(v)) and ok(v):
            out[name] = v if want_int else float(v)
        else:
            c.bad(name, f"must be {valid}, got {json.dumps(v)}")

    num(max_tokens_key, lambda v: v >= 1, "an integer >= 1", want_int=True)
    if max_tokens_key in out:
        out["max_tokens"] = out.pop(max_tokens_key)
    num("temperature", lambda v: v >= 0, "a number >= 0")
    num("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")
    num("top_k", lambda v: v >= -1, "an integer >= -1 (0 or -1: disabled)", want_int=True)
    num("min_p", lambda v: 0 <= v <= 1, "a number in [0, 1]")
    num("seed", lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)", want_int=True)
    if out.get("top_k") == -1:
        out["top_k"] = 0
    stop = obj.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
            out["stop"] = tuple(stop)
        else:
            c.bad("stop", "must be a non-empty string or a list of non-empty strings")
    for name in ("ignore_eos", "stream"):
        v = obj.get(name)
        if v is not None and not isinstance(v, bool):
            c.bad(name, f"must be true or false, got {json.dumps(v)}")
        elif name == "ignore_eos" and v is not None:
            out[name] = v
    return out


def parse_messages(v: Any, c: Checker) -> list[dict] | None:
    """Validate a chat message list; OpenAI text-part lists become one content string."""
    if not isinstance(v, list) or not v:
        c.bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
        return None
    msgs = []
    for i, m in enumerate(v):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            c.bad(name, "must be an object with \"role\" and \"content\"")
            continue
        c.unknown(m, ("role", "content", "name"), prefix=name + ".")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            c.bad(name + ".role", "must be a non-empty string")
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            content = "".join(p["text"] for p in content)  # OpenAI text parts
        if not isinstance(content, str):
            c.bad(name + ".content", "must be a string (or a list of text parts)")
        msgs.append({**m, "content": content})
    return msgs


def parse_prompt(obj: Mapping, c: Checker, keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """The one prompt field of ``obj`` among ``keys``: (kind, payload), or None on error."""
    given = [k for k in keys if obj.get(k) is not None]
    if len(given) != 1:
        need = "is required" if len(keys) == 1 else f"exactly one of {', '.join(keys)} is required"
        c.bad(keys[0] if not given else None, need + (f", got {', '.join(given)}" if given else ""))
        return None
    key, v = given[0], obj[given[0]]
    if key == "messages":
        msgs = parse_messages(v, c)
        return None if msgs is None else ("messages", msgs)
    if key == "prompt" and isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]  # OpenAI completions: a list holding one prompt
    if isinstance(v, str):
        if key != "prompt":
            c.bad(key, "must be a list of token ids")
            return None
        if not v:
            c.bad(key, "must be non-empty")
            return None
        return "prompt", v
    if isinstance(v, list) and v and all(is_int(t) and t >= 0 for t in v):
        return "token_ids", list(v)
    c.bad(key, "must be a non-empty string" if key == "prompt" and not isinstance(v, list)
          else "must be a non-empty list of integer token ids >= 0")
    return None


def parse_batch(obj: dict, c: Checker) -> tuple[str | None, str | None, tuple | None, dict, str | None]:
    """OpenAI Batch line -> (id, format, (kind, payload), sampling kwargs, model)."""
    c.unknown(obj, BATCH_FIELDS)
    rid = obj.get("custom_id")
    if not isinstance(rid, str) or not rid:
        c.bad("custom_id", "must be a non-empty string")
        rid = None
    if obj.get("method") != "POST":
        c.bad("method", f"must be \"POST\", got {json.dumps(obj.get('method'))}")
    fmt = URLS.get(obj.get("url"))
    if fmt is None:
        c.bad("url", f"must be one of {', '.join(URLS)}, got {json.dumps(obj.get('url'))}")
    body = obj.get("body")
    if not isinstance(body, dict):
        c.bad("body", "must be an object")
        return rid, fmt, None, {}, None
    c.prefix = "body."
    chat = fmt == "openai_chat"
    c.unknown(body, [k for k in BODY_FIELDS if k != ("prompt" if chat else "messages")])
    prompt = parse_prompt(body, c, ("messages",) if chat else ("prompt",)) if fmt else None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    kw = parse_sampling(body, c, max_tokens_key=key)
    for k, neutral in BODY_NEUTRAL.items():
        if k in body and body[k] not in neutral:
            c.bad(k, f"not supported by tpengine; only {' or '.join(json.dumps(v) for v in neutral)}, "
                     f"got {json.dumps(body[k])}")
    if body.get("n") not in (None, 1):
        c.bad("n", f"only n=1 is supported, got {json.dumps(body.get('n'))}")
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return rid, fmt, prompt, kw, model
