"""Reasoning parsers: a thinking model's ``<think>...</think>`` text -> ``reasoning_content``, the
rest -> ``content`` (vLLM's ``--reasoning-parser``; ``qwen3`` and ``deepseek_r1`` write the same tags).

An output that starts with ``<think>`` is reasoning until ``</think>`` (all of it when it never
closes: a truncated thought); the text after the tag, less its leading newlines, is the content.
An output that does not start with ``<think>`` is all content (Qwen3 with ``enable_thinking`` false,
whose prompt already closed the thought: the engine then constrains the output from its start).
"""

from __future__ import annotations

from tpengine.config import REASONING_PARSER_NAMES
from tpengine.frontend.tool_parsers import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    """Splits an output into (reasoning, content) at the reasoning tags."""

    name = "qwen3"
    start, end = START, END

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of ``text``, each None when there is none. While streaming
        (``finished`` False) text that may still be the start of a tag is held back (in neither)."""
        lead = text.lstrip()
        if not lead.startswith(self.start):
            if not finished and self.start.startswith(lead):
                return None, None  # maybe the opening tag
            return None, text or None
        body = lead[len(self.start):]
        i = body.find(self.end)
        if i < 0:
            thought = body if finished else body[: len(body) - held_back(body, self.end)]
            return thought.lstrip("\n") or None, None
        content = body[i + len(self.end):].lstrip("\n")
        return body[:i].lstrip("\n") or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


#: ``--reasoning-parser`` values.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (ReasoningParser, DeepSeekR1ReasoningParser)}
assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES
