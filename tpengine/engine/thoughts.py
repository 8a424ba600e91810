"""The end of a thinking model's thought, as ONE decision: the token ids of a reasoning parser's tags
and where, in a sample's tokens, its thought ends. The engine's grammar starts there
(:mod:`tpengine.engine.structured_output`) and the chat response's ``reasoning_content`` / ``content``
split is made there (:mod:`tpengine.frontend.reasoning`, which holds the parsers' rules).

Both tags must be ONE token each of the tokenizer (vLLM's parsers refuse to start otherwise): the
thought ends at the first ``</think>`` token written inside it, never at the same text spelled by
smaller tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tpengine.errors import UserError

START, END = "<think>", "</think>"


class ReasoningTagsMissing(UserError):
    """The tokenizer lacks a reasoning tag as one token (the parser cannot start)."""


def _vocab_id(tokenizer, tag: str) -> int | None:
    """The id of ``tag`` as one token of ``tokenizer`` (its vocabulary or its added tokens), else None."""
    vocab = tokenizer.get_vocab()
    if tag in vocab:
        return int(vocab[tag])
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tag else None


@dataclass(frozen=True)
class ThoughtTags:
    """The token ids of a reasoning parser's tags: ``start_id`` (``<think>``), ``end_id`` (``</think>``)."""

    start_id: int
    end_id: int

    def prompt_state(self, prompt_ids: Sequence[int]) -> bool | None:
        """What the prompt says of the thought: True (its last tag token opens one), False (its last
        tag token closes one), None (it holds no tag token)."""
        for t in reversed(prompt_ids):
            if t == self.start_id:
                return True
            if t == self.end_id:
                return False
        return None

    def thought_end(self, output_ids: Sequence[int], thinking: bool) -> int | None:
        """How many leading ``output_ids`` the thought takes, its ``</think>`` included: 0 when the
        output does not start inside one (``thinking`` False), None while it has not ended."""
        if not thinking:
            return 0
        for i, t in enumerate(output_ids):
            if t == self.end_id:
                return i + 1
        return None


_FOUND: dict[int, tuple[object, ThoughtTags]] = {}  # id(tokenizer) -> (the tokenizer, its tags)


def thought_tags(parser: str | None, tokenizer) -> ThoughtTags | None:
    """The tag ids of ``parser`` (a ``--reasoning-parser`` name) in ``tokenizer`` (looked up once per
    tokenizer); None without a parser.

    Raises:
        ReasoningTagsMissing: a tag is not one token of the tokenizer (naming the parser, the tag and
            the tokenizer), as vLLM's parsers refuse to start.
    """
    if parser is None:
        return None
    if (found := _FOUND.get(id(tokenizer))) is not None and found[0] is tokenizer:
        return found[1]
    ids = {}
    for tag in (START, END):
        ids[tag] = _vocab_id(tokenizer, tag)
        if ids[tag] is None:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            spelled = tokenizer.convert_ids_to_tokens(tokenizer.encode(tag, add_special_tokens=False))
            raise ReasoningTagsMissing(
                f"--reasoning-parser {parser}: the tokenizer of {name} has no {tag!r} token (it spells it as "
                f"{len(spelled)} tokens {spelled}); the {parser} parser reads {START} and {END} as one token each, "
                "as vLLM's does; serve a model whose tokenizer has them, or leave --reasoning-parser out")
    _FOUND[id(tokenizer)] = (tokenizer, ThoughtTags(ids[START], ids[END]))
    return _FOUND[id(tokenizer)][1]
