"""The grammar libraries behind structured outputs: xgrammar (vLLM's default) and llguidance
(vLLM's ``guidance`` backend, llama.cpp's). Each compiles a :class:`StructuredOutputsParams` into a
grammar over the model's vocabulary, and each grammar makes matchers: one per generated sample,
which fills that sample's row of the token bitmask and accepts the sampled token.

The bitmask is the two libraries' shared layout: int32 ``[rows, ceil(vocab_size / 32)]``, bit ``t % 32``
of word ``t // 32`` set when token ``t`` is allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from tpengine.structured.params import StructuredOutputsParams


class GrammarError(ValueError):
    """The constraint cannot be compiled (a bad schema, regex or grammar); the message says why."""


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # xgrammar's "[21:52:51] /project/cpp/x.cc:94: "


def _xgrammar_message(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e).strip())


class Matcher:
    """One sample's position in a grammar."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[rows, words]``)."""
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) when the grammar does not allow it."""
        raise NotImplementedError

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow."""
        raise NotImplementedError


class Grammar:
    """A compiled constraint; :meth:`matcher` starts a sample at its beginning."""

    backend: str

    def matcher(self) -> Matcher:
        raise NotImplementedError


class _XgrammarMatcher(Matcher):
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class _XgrammarGrammar(Grammar):
    backend = "xgrammar"

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def matcher(self) -> Matcher:
        return _XgrammarMatcher(self.compiled)


class XgrammarBackend:
    """xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
    Large Language Models", arXiv:2411.15100) over a Hugging Face tokenizer.

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the logits row width (the model's vocabulary, padding ids included).
        stop_token_ids: the ids that end a sample (the engine's EOS ids): the only ones allowed once
            the grammar is complete.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, p: StructuredOutputsParams) -> Grammar:
        """Raises GrammarError: xgrammar refuses the constraint (its message, without the C++ prefix)."""
        c, ws = self._compiler, not p.disable_any_whitespace
        try:
            if p.kind == "json":
                return _XgrammarGrammar(c.compile_json_schema(p.spec, any_whitespace=ws))
            if p.kind == "json_object":
                return _XgrammarGrammar(c.compile_json_schema('{"type": "object"}', any_whitespace=ws))
            if p.kind == "regex":
                return _XgrammarGrammar(c.compile_regex(p.regex))
            if p.kind == "choice":
                return _XgrammarGrammar(c.compile_grammar(_choice_rule("root ::= ", p.choice)))
            return _XgrammarGrammar(c.compile_grammar(p.grammar))
        except Exception as e:  # noqa: BLE001 -- xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarError(_xgrammar_message(e)) from None


class _GuidanceMatcher(Matcher):
    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        self._m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token)) and not self._m.is_error()

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())


class _GuidanceGrammar(Grammar):
    backend = "guidance"

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._tokenizer, self.grammar = tokenizer, grammar

    def matcher(self) -> Matcher:
        return _GuidanceMatcher(self._tokenizer, self.grammar)


class GuidanceBackend:
    """llguidance (Microsoft's Guidance team, https://github.com/guidance-ai/llguidance) over a
    Hugging Face tokenizer; same arguments as :class:`XgrammarBackend` (llguidance takes one EOS id:
    the tokenizer's when it is a stop id, else the first stop id)."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance.hf

        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in stop_token_ids or not stop_token_ids else \
            stop_token_ids[0]
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, p: StructuredOutputsParams) -> Grammar:
        """Raises GrammarError: llguidance refuses the constraint (its message)."""
        import llguidance

        ws = {"whitespace_flexible": not p.disable_any_whitespace}
        try:
            if p.kind == "json":
                g = llguidance.LLMatcher.grammar_from_json_schema(p.spec, defaults=ws)
            elif p.kind == "json_object":
                g = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=ws)
            elif p.kind == "regex":
                g = llguidance.LLMatcher.grammar_from_regex(p.regex)
            elif p.kind == "choice":
                g = llguidance.LLMatcher.grammar_from_lark(_choice_rule("start: ", p.choice))
            else:
                g = llguidance.LLMatcher.grammar_from_lark(p.grammar)
            problem = llguidance.LLMatcher.validate_grammar(g, self._tokenizer)
        except Exception as e:  # noqa: BLE001 -- llguidance raises ValueError / RuntimeError
            raise GrammarError(str(e).strip()) from None
        if problem:
            raise GrammarError(problem.strip())
        return _GuidanceGrammar(self._tokenizer, g)


#: JSON-schema keywords xgrammar compiles without enforcing them, by the type they constrain (vLLM's
#: ``has_xgrammar_unsupported_json_features`` list); "auto" sends such a schema to guidance.
_XGRAMMAR_IGNORES = {"number": ("multipleOf",), "integer": ("multipleOf",),
                     "array": ("uniqueItems", "contains", "minContains", "maxContains"),
                     "object": ("patternProperties", "propertyNames")}


def xgrammar_unsupported(schema: Any) -> str | None:
    """The first keyword of ``schema`` (at any depth) that xgrammar would not enforce, e.g.
    "uniqueItems", or "maxLength with format" (xgrammar drops a string's length bounds when it has a
    ``format``; llguidance keeps both); None when xgrammar enforces all of it."""
    if isinstance(schema, list):
        return next((r for s in schema if (r := xgrammar_unsupported(s)) is not None), None)
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        for key in _XGRAMMAR_IGNORES.get(kind, ()):
            if key in schema:
                return key
    if "format" in schema and ("maxLength" in schema or "minLength" in schema):
        return f"{'maxLength' if 'maxLength' in schema else 'minLength'} with format"
    return next((r for v in schema.values() if isinstance(v, (dict, list))
                 and (r := xgrammar_unsupported(v)) is not None), None)


def _choice_rule(head: str, choices: tuple[str, ...]) -> str:
    """One grammar rule matching exactly one of ``choices``; both libraries read JSON string escapes."""
    return head + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


BACKEND_CLASSES = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
