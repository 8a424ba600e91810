"""The engine's logprobs (:class:`tpengine.engine.outputs.PositionLogprobs`) in each record shape:
the simple record's, OpenAI's legacy completions and chat shapes, and vLLM's ``prompt_logprobs``.

Logprobs are natural logs; -inf (a token a bias or ``min_tokens`` ruled out) is written as
:data:`MIN_LOGPROB` (vLLM's -9999.0), as JSON has no infinity. A token whose text is unknown
(``Logprob.token`` None) is ``""`` in the OpenAI shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpengine.engine.outputs import Logprob, PositionLogprobs
from tpengine.protocol.records import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    SimplePositionLogprobs,
    TokenLogprob,
)

MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


def _text(lp: Logprob) -> str:
    return lp.token if lp.token is not None else ""


def _simple_token(lp: Logprob) -> TokenLogprob:
    return TokenLogprob(token_id=lp.token_id, token=lp.token, logprob=_lp(lp.logprob))


def simple_position(pos: PositionLogprobs) -> SimplePositionLogprobs:
    """``{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}, ...]}``."""
    c = pos.chosen
    return SimplePositionLogprobs(token_id=c.token_id, token=c.token, logprob=_lp(c.logprob),
                                  top_logprobs=[_simple_token(t) for t in pos.top])


def simple_logprobs(positions: Sequence[PositionLogprobs | None] | None) -> list | None:
    """A simple record's ``logprobs`` / ``prompt_logprobs`` (None stays None, per position too)."""
    if positions is None:
        return None
    return [None if p is None else simple_position(p) for p in positions]


def completion_logprobs(positions: Sequence[PositionLogprobs], text_offset: int = 0) -> CompletionLogprobs:
    """OpenAI's legacy completions ``logprobs`` of generated ``positions``; ``text_offset``: the
    character offset of the first token's text (the length of the text before it: 0, or what a
    stream has sent). ``top_logprobs[i]``: the top tokens' ``{text: logprob}``, then the chosen
    token's when it is not among them (as vLLM)."""
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = text_offset
    for p in positions:
        text = _text(p.chosen)
        out.tokens.append(text)
        out.token_logprobs.append(_lp(p.chosen.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        top = {_text(t): _lp(t.logprob) for t in p.top}
        top.setdefault(text, _lp(p.chosen.logprob))
        out.top_logprobs.append(top)
    return out


def echo_logprobs(tokens: Sequence[str], positions: Sequence[PositionLogprobs | None] | None, k: int,
                  generated: Sequence[PositionLogprobs], text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy completions ``logprobs`` of an echoed prompt and its completion (vLLM's
    ``echo``): the prompt's tokens first, with the text of each (``tokens``), its logprob and its
    ``k`` top tokens from ``positions`` (the engine's prompt logprobs; the first token and, without
    them, every prompt token has ``null``), offsets from 0; then the ``generated`` positions as
    :func:`completion_logprobs`, from ``text_offset`` (the length of the echoed text)."""
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = 0
    for j, text in enumerate(tokens):
        p = positions[j] if positions is not None and j < len(positions) else None
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if p is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_lp(p.chosen.logprob))
        top = {_text(t): _lp(t.logprob) for t in p.top[:k]}
        top.setdefault(text, _lp(p.chosen.logprob))
        out.top_logprobs.append(top)
    rest = completion_logprobs(generated, text_offset)
    out.tokens += rest.tokens
    out.text_offset += rest.text_offset
    out.token_logprobs += rest.token_logprobs
    out.top_logprobs += rest.top_logprobs
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="surrogatepass"))


def chat_logprobs(positions: Sequence[PositionLogprobs]) -> ChatLogprobs:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
    [{"token", "logprob", "bytes"}, ...]}, ...]}`` of generated ``positions``."""
    content = []
    for p in positions:
        text = _text(p.chosen)
        top = [ChatTopLogprob(token=_text(t), logprob=_lp(t.logprob), bytes=_bytes(_text(t))) for t in p.top]
        content.append(ChatTokenLogprob(token=text, logprob=_lp(p.chosen.logprob), bytes=_bytes(text),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def openai_prompt_logprobs(positions: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's OpenAI ``prompt_logprobs``: per prompt position None (the first) or ``{token id:
    {"logprob", "rank", "decoded_token"}}`` of the prompt's token there, then the top tokens."""
    if positions is None:
        return None
    out: PromptLogprobs = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        entry: dict[int, PromptLogprob] = {}
        for t in (p.chosen, *p.top):
            entry.setdefault(t.token_id, PromptLogprob(logprob=_lp(t.logprob), rank=t.rank, decoded_token=t.token))
        out.append(entry)
    return out
