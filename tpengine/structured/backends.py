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


#: Keywords that only describe (annotations) or hold subschemas reached on their own: beside ``$ref``,
#: ``anyOf``, ``enum`` or ``const`` they constrain nothing xgrammar would drop.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor", "contentMediaType", "contentEncoding", "$defs",
                          "definitions", "discriminator"})
#: Keywords xgrammar compiles without enforcing wherever they appear: it reads ``oneOf`` as ``anyOf``
#: (a value matching two alternatives passes) and skips the rest.
_XGRAMMAR_NEVER = ("allOf", "oneOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                   "dependencies", "contains", "minContains", "maxContains")
#: Formats with a meaning xgrammar checks only in part (calendar days of ``date`` / ``date-time``) or
#: not at all while a validator checks them; any other format it does not know is free text, as the
#: JSON-schema specification allows for an unknown format.
_XGRAMMAR_LOOSE_FORMATS = frozenset({"date", "date-time", "idn-email", "idn-hostname", "regex", "iri",
                                     "iri-reference"})
_STRING_KW = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
          "object": (dict,), "array": (list,)}
#: Where a schema holds subschemas: one, a list of them, a map of name -> subschema.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _of_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return (isinstance(value, int) or isinstance(value, float) and value.is_integer()) \
            and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(kind, ())) and not (kind != "boolean" and isinstance(value, bool))


def _xgrammar_node(s: dict[str, Any]) -> str | None:
    """The first constraint of the schema node ``s`` itself (not its subschemas) that xgrammar drops."""
    for key in _XGRAMMAR_NEVER:
        if key in s:
            return key
    if s.get("uniqueItems"):
        return "uniqueItems"
    kinds = s.get("type")
    kinds = kinds if isinstance(kinds, list) else [] if kinds is None else [kinds]
    for head in ("$ref", "anyOf"):
        if head in s:
            extra = [k for k in s if k not in _ANNOTATIONS and k not in (head, "type")]
            alternatives = s.get("anyOf") if head == "anyOf" else None
            typed = isinstance(alternatives, list) and all(
                isinstance(a, dict) and a.get("type") is not None and set(
                    a["type"] if isinstance(a["type"], list) else [a["type"]]) <= set(kinds) for a in alternatives)
            if "type" in s and not typed:
                extra.insert(0, "type")
            if extra:
                return f"{extra[0]} beside {head}"
    for head in ("enum", "const"):
        if head in s:
            extra = [k for k in s if k not in _ANNOTATIONS and k not in ("enum", "const", "type")]
            if extra:
                return f"{extra[0]} beside {head}"
            values = s[head] if head == "enum" and isinstance(s[head], list) else [s[head]]
            if kinds and any(not any(_of_type(v, k) for k in kinds) for v in values):
                return f"type beside {head} (a value of another type)"
            return None
    if not kinds:
        typeless = [*_STRING_KW, *_NUMBER_KW, "minProperties", "maxProperties"]
        if "items" not in s and "prefixItems" not in s:
            typeless += ["minItems", "maxItems"]
        if "properties" not in s:
            typeless.append("required")
        return next((f"{k} without type" for k in typeless if k in s), None)
    if "string" in kinds:
        fmt = s.get("format")
        if fmt in _XGRAMMAR_LOOSE_FORMATS:
            return f"format {fmt!r}"
        if fmt is not None or "pattern" in s:
            with_ = "format" if fmt is not None else "pattern"
            other = next((k for k in ("pattern", "minLength", "maxLength") if k in s and k != with_), None)
            if other is not None:
                return f"{other} with {with_}"
    if "number" in kinds and "multipleOf" in s:
        return "multipleOf"
    if "integer" in kinds:
        for k in _NUMBER_KW:
            if k in s and not _of_type(s[k], "integer"):
                return f"{k} that is not a whole number on an integer"
    return None


def xgrammar_unsupported(schema: Any, where: str = "#") -> str | None:
    """The first constraint of ``schema`` (at any depth) that xgrammar would compile without enforcing,
    and where it is as a JSON pointer, e.g. ``"uniqueItems (at #/properties/tags)"``,
    ``"maxLength with format (at #)"``; None when xgrammar enforces all of it.

    What xgrammar (0.2) drops: ``allOf``, ``oneOf`` (read as ``anyOf``), ``not``, ``if`` / ``then`` /
    ``else``, ``dependent*``, ``contains`` and ``min/maxContains``, ``uniqueItems``; a string's length
    bounds beside ``pattern`` or ``format``, and ``pattern`` beside ``format``; the calendar of
    ``date`` / ``date-time`` and the formats of :data:`_XGRAMMAR_LOOSE_FORMATS`; ``multipleOf`` on
    numbers and a fractional one (or fractional bounds) on integers; any constraint beside ``$ref``
    or ``anyOf`` (a ``type`` beside ``anyOf`` only where an alternative may be of another type),
    beside ``enum`` / ``const`` (``type`` only where a value is of another type); and a type's
    keywords in a schema without ``type`` (``minimum``, ``maxLength``, ``required`` without
    ``properties``, ...)."""
    if not isinstance(schema, dict):
        return None
    found = _xgrammar_node(schema)
    if found is not None:
        return f"{found} (at {where})"
    for key in _ONE:
        sub = schema.get(key)
        if key == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
            sub = {"type": "string", **sub}  # it constrains names: strings
        if isinstance(sub, dict) and (r := xgrammar_unsupported(sub, f"{where}/{key}")) is not None:
            return r
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if (r := xgrammar_unsupported(sub, f"{where}/{key}/{i}")) is not None:
                    return r
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if (r := xgrammar_unsupported(sub, f"{where}/{key}/{_pointer(name)}")) is not None:
                    return r
    return None


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _choice_rule(head: str, choices: tuple[str, ...]) -> str:
    """One grammar rule matching exactly one of ``choices``; both libraries read JSON string escapes."""
    return head + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


BACKEND_CLASSES = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
