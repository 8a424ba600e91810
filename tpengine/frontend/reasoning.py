"""Reasoning parsers (vLLM's ``--reasoning-parser``): a thinking model's thought -> ``reasoning_content``,
the rest -> ``content``; and the one decision of where the thought ends, which the chat response and
the engine's grammar share.

Both parsers read ``<think>`` / ``</think>``, and both need each tag to be ONE token of the tokenizer
(vLLM's rule: its parsers refuse a tokenizer without them at start-up; :func:`thought_tags` here).
The thought ends at the first ``</think>`` token the model writes while thinking -- a token, not a
text: the same ``</think>`` spelled by several smaller tokens is part of the thought, so what the
response calls content is exactly what the grammar constrained. Where a sample starts:

* the prompt decides first, as vLLM's ``is_reasoning_end`` does: the last tag token in it is
  ``</think>`` -> the thought is over (Qwen3's template with ``enable_thinking`` false closes it; an
  earlier assistant turn's thought followed by a new ``<think>`` does not); ``<think>`` -> the output
  starts inside the thought (DeepSeek R1's template opens it);
* no tag in the prompt: the output starts inside the thought for ``deepseek_r1`` (R1 may or may not
  write ``<think>`` itself); for ``qwen3`` too, unless the request's ``chat_template_kwargs`` say
  ``enable_thinking: false`` (then all of it is content, vLLM's Qwen3 rule).

Inside the thought a ``<think>`` token is dropped with what came before it (vLLM's ``partition``);
a thought that never ends (cut off by ``max_tokens``) is all ``reasoning_content``, content None (vLLM's
output). The split keeps the text as written: no whitespace is stripped on either side.

The engine learns the decision through ``SamplingParams.thinking`` (set by the chat front ends:
:meth:`ReasoningParser.for_request`); a request without it (completions, simple batch lines, the
``LLM`` API) is constrained from its first token, whatever ``--reasoning-parser`` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tpengine.config import REASONING_PARSER_NAMES
from tpengine.engine.thoughts import END, START, ReasoningTagsMissing, ThoughtTags, thought_tags

__all__ = ["END", "REASONING_PARSERS", "START", "Qwen3ReasoningParser", "ReasoningParser", "ReasoningTagsMissing",
           "ThoughtTags", "thought_tags"]

class ReasoningParser:
    """One chat request's reasoning split (a new instance per request: it caches its offsets).

    Args:
        tags: the tokenizer's tag ids (:func:`thought_tags`).
        tokenizer: decodes output prefixes to place the tags in the text.
        thinking: whether the output starts inside the thought (:meth:`starts_thinking`).
        prompt_ids: the request's prompt (the engine decodes the output after its last tokens).
        skip_special_tokens: the request's (the text was decoded with it).
    """

    name = "deepseek_r1"

    def __init__(self, tags: ThoughtTags, tokenizer, thinking: bool = True, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tags, self.tokenizer, self.thinking, self.skip = tags, tokenizer, thinking, skip_special_tokens
        self.prompt_ids = list(prompt_ids)
        self._cut: dict[tuple[int, ...], int] = {}  # output ids -> the length of their text

    @classmethod
    def starts_thinking(cls, tags: ThoughtTags, prompt_ids: Sequence[int],
                        template_kwargs: Mapping[str, Any] | None = None) -> bool:
        """Whether the output of ``prompt_ids`` starts inside a thought (see the module's rules)."""
        state = tags.prompt_state(prompt_ids)
        return True if state is None else state

    @classmethod
    def for_request(cls, tags: ThoughtTags, tokenizer, prompt_ids: Sequence[int],
                    template_kwargs: Mapping[str, Any] | None = None,
                    skip_special_tokens: bool = True) -> ReasoningParser:
        """The parser of one chat request, its start decided from the prompt and the template's kwargs."""
        return cls(tags, tokenizer, cls.starts_thinking(tags, prompt_ids, template_kwargs), prompt_ids,
                   skip_special_tokens)

    def _text_len(self, ids: Sequence[int], n: int) -> int:
        """The length of the text of the output ``ids[:n]`` as the engine decodes it (after the
        prompt, :class:`tpengine.engine.detokenizer.IncrementalDetokenizer`); cached (the samples of
        ``n > 1`` share the parser)."""
        key = tuple(ids[:n])
        if key not in self._cut:
            from tpengine.engine.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=self.skip,
                                           prompt_token_ids=self.prompt_ids)
            for t in key:
                detok.append(t)
            self._cut[key] = len(detok.text)
        return self._cut[key]

    def split(self, text: str, token_ids: Sequence[int], finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output's ``text`` and its ``token_ids``, each None when empty.
        While streaming (``finished`` False) ``text`` may lag behind ``token_ids`` (the detokenizer
        holds back what may change); every prefix's split extends the one before."""
        if not self.thinking:
            return None, text or None
        ids = list(token_ids)
        end = self.tags.thought_end(ids, True)
        stop = len(ids) if end is None else end - 1  # the thought's tokens: ids[:stop]
        start = next((i + 1 for i, t in enumerate(ids[:stop]) if t == self.tags.start_id), 0)
        a = self._text_len(ids, start) if start else 0
        if end is None:
            return text[a:] or None, None
        b, c = self._text_len(ids, stop), self._text_len(ids, end)
        return text[a:min(b, len(text))] or None, text[c:] or None  # text[c:] is "" until the text has the tag


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: as DeepSeek R1's, and thinking is off per request with ``chat_template_kwargs``
    ``{"enable_thinking": false}`` (a prompt with no tag then starts in the content)."""

    name = "qwen3"

    @classmethod
    def starts_thinking(cls, tags: ThoughtTags, prompt_ids: Sequence[int],
                        template_kwargs: Mapping[str, Any] | None = None) -> bool:
        state = tags.prompt_state(prompt_ids)
        if state is None:
            return (template_kwargs or {}).get("enable_thinking", True) is not False
        return state


#: ``--reasoning-parser`` values.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser,
                                                       "deepseek_r1": ReasoningParser}
assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES
