"""Every JSON-schema keyword enforced or refused (issue 54): a table of schemas, one or two keywords
each, walked through both grammar libraries (and "auto") in process over SmolLM2's tokenizer. For
each, the backend either refuses the schema with a message naming the keyword, or it keeps it: every
instance the ``jsonschema`` library rejects is refused by the grammar token by token, and what a
mask-driven sampler (greedy, and seeded) writes under the grammar validates. Through the server and
the batch job: ``test_structured_keywords_e2e.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SMOLLM2_DIR

from tpengine.structured import GrammarError
from tpengine.structured import StructuredOutputsParams as S
from tpengine.structured.backends import xgrammar_unsupported

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")
EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152
#: The rows also sampled (greedy and seeded) under the grammar: short values whose keywords bound
#: what a sampler can write (the other rows' invalid instances are refused token by token).
SAMPLED = ("anyOf", "min/maxItems", "minimum/maximum", "exclusive",
           "additionalProperties false", "nested")

INT = {"type": "integer"}
#: (name, schema, instances the validator rejects, xgrammar's refusal or None, guidance's refusal or
#: None): a refusal is the keyword part of the message (``xgrammar does not enforce <it>`` / guidance's
#: own words); None: that library enforces the schema.
TABLE = [
    ("pattern+length", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5},
     ['"ab"', '"abcdefg"', '"a1c"'], "minLength with pattern (at #)", None),
    ("length", {"type": "string", "minLength": 2, "maxLength": 3}, ['"a"', '"abcd"'], None, None),
    ("format date", {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
     ['{"d": "2021-02-30"}', '{"d": "soon"}'], "format 'date' (at #/properties/d)", None),
    ("format uuid", {"type": "string", "format": "uuid"}, ['"1234"'], None, None),
    ("format email", {"type": "string", "format": "email", "pattern": "^a"}, ['"a.b"'], "pattern with format (at #)",
     None),
    ("format+maxLength", {"type": "string", "format": "email", "maxLength": 8}, ['"abcd@ef.gh"'],
     "maxLength with format (at #)", None),
    ("format regex", {"type": "string", "format": "regex"}, ['"a("'], "format 'regex' (at #)",
     "Unknown format: regex"),
    ("enum", {"enum": ["red", 1, None]}, ['"blue"', "2"], None, None),
    ("enum+type", {"type": "string", "enum": ["a", 1]}, ["1"], "type beside enum (a value of another type) (at #)",
     None),
    ("const", {"const": {"a": [1, 2]}}, ['{"a": [1]}'], None, None),
    ("anyOf", {"anyOf": [{"type": "integer", "minimum": 5}, {"type": "string", "maxLength": 2}]}, ["3", '"abc"'],
     None, None),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["3"], "oneOf (at #)",
     "oneOf constraints are not supported"),
    ("oneOf disjoint", {"oneOf": [INT, {"type": "string", "maxLength": 2}]}, ["true", '"abc"'], "oneOf (at #)", None),
    ("allOf", {"allOf": [INT, {"minimum": 3}]}, ["1"], "allOf (at #)", None),
    ("not", {"type": "integer", "not": {"const": 3}}, ["3"], "not (at #)", 'Unimplemented keys: ["not"]'),
    ("$ref/$defs", {"type": "object", "properties": {"a": {"$ref": "#/$defs/P"}}, "required": ["a"],
                    "$defs": {"P": {"type": "integer", "minimum": 2, "maximum": 4}}}, ['{"a": 5}', "{}"], None, None),
    ("$ref+sibling", {"type": "object", "properties": {"a": {"$ref": "#/$defs/P", "maximum": 3}}, "required": ["a"],
                      "$defs": {"P": INT}}, ['{"a": 5}'], "maximum beside $ref (at #/properties/a)", None),
    ("min/maxItems", {"type": "array", "items": INT, "minItems": 2, "maxItems": 3}, ["[1]", "[1, 2, 3, 4]"], None,
     None),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, ["[1, 1]"], "uniqueItems (at #)",
     'Unimplemented keys: ["uniqueItems"]'),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 7}}, ["[1]"], "contains (at #)",
     'Unimplemented keys: ["contains"]'),
    ("minimum/maximum", {"type": "integer", "minimum": -3, "maximum": 12}, ["-4", "13"], None, None),
    ("exclusive", {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 1.5}, ["0.5", "1.5", "2"], None,
     None),
    ("multipleOf integer", {"type": "integer", "multipleOf": 5}, ["7"], None, None),
    ("multipleOf number", {"type": "number", "multipleOf": 0.5}, ["0.3"], "multipleOf (at #)", None),
    ("additionalProperties false", {"type": "object", "properties": {"a": INT}, "additionalProperties": False},
     ['{"b": 1}'], None, None),
    ("additionalProperties schema", {"type": "object", "properties": {"a": INT}, "additionalProperties": INT},
     ['{"b": "x"}'], None, None),
    ("required", {"type": "object", "properties": {"a": INT, "b": {"type": "string"}}, "required": ["b"]},
     ['{"a": 1}', "{}"], None, None),
    ("keyword without type", {"minimum": 3}, ["1"], "minimum without type (at #)", None),
    ("if/then", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, ["25"], "if (at #)",
     'Unimplemented keys: ["if", "then"]'),
    ("dependentRequired", {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     ['{"a": 1}'], "dependentRequired (at #)", 'Unimplemented keys: ["dependentRequired"]'),
    ("nested", {"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {
        "type": "array", "items": {"enum": ["p", "q"]}, "minItems": 1}}, "required": ["x"],
        "additionalProperties": False}}, "required": ["o"], "additionalProperties": False},
     ['{"o": {"x": []}}', '{"o": {"x": ["r"]}}', '{"o": {}}'], None, None),
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


@pytest.fixture(scope="module")
def managers(tok):
    from tpengine.structured import StructuredOutputManager

    ms = {b: StructuredOutputManager(tok, VOCAB, [EOS], backend=b) for b in ("xgrammar", "guidance", "auto")}
    yield ms
    for m in ms.values():
        m.close()


@pytest.fixture(scope="module")
def short_bias(tok):
    """A logit bonus for the stop token and tokens that close a value (a quote, bracket or brace), and
    a malus for whitespace, so the sampler's outputs end within a few dozen tokens instead of writing
    long strings, numbers or free whitespace."""
    bias = torch.zeros(VOCAB)
    for t, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if any(c in piece for c in '"]}'):
            bias[t] = 3.0
        elif not tok.decode([t]).strip():
            bias[t] = -8.0
    bias[EOS] = 3.0
    return bias


def _banned(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[VOCAB]``: the tokens row 0 of the int32 bitmask ``mask`` does not allow."""
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return torch.from_numpy(bits == 0)


def _validator(schema):
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def _accepts(grammar, tok, text: str) -> bool:
    m = grammar.matcher()
    return all(m.accept(t) for t in tok.encode(text)) and (m.is_terminated or m.accept(EOS))


def _sample(manager, grammar, tok, bias, seed: int | None, max_tokens: int = 24) -> str | None:
    """A text the grammar writes when random logits (fixed by ``seed``; argmax when ``seed`` is None,
    a draw at temperature 0.5 otherwise) are masked by its bitmask; None when it has not ended in
    ``max_tokens``."""
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    m, ids = grammar.matcher(), []
    for _ in range(max_tokens):
        logits = torch.randn(VOCAB, generator=g) + bias
        logits[_banned(manager.fill([m]))] = float("-inf")
        t = int(logits.argmax()) if seed is None else int(torch.multinomial(torch.softmax(logits * 2, -1), 1,
                                                                               generator=g))
        if t == EOS:
            return tok.decode(ids)
        assert m.accept(t)
        ids.append(t)
        if m.is_terminated:
            return tok.decode(ids)
    return None


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_every_keyword_is_enforced_or_refused_by_name(managers, tok, short_bias, backend):
    """Each row: a refusal naming the keyword, or a grammar that refuses every invalid instance and
    whose greedy and seeded outputs validate."""
    m, finished = managers[backend], 0
    for name, schema, bads, xgr_refusal, guidance_refusal in TABLE:
        refusal = xgr_refusal if backend == "xgrammar" else guidance_refusal
        for bad in bads:
            assert not _validator(schema).is_valid(json.loads(bad)), (name, bad)
        if refusal is not None:
            with pytest.raises(GrammarError) as e:
                m.compile(S(json=schema)).result()
            want = f"xgrammar does not enforce {refusal}" if backend == "xgrammar" else refusal
            assert str(e.value).startswith(f"cannot compile the JSON schema: {want}"), (name, str(e.value))
            continue
        grammar = m.compile(S(json=schema)).result()
        for bad in bads:
            assert not _accepts(grammar, tok, bad), (name, backend, bad)
        for seed in (None, 7) if name in SAMPLED else ():
            text = _sample(m, grammar, tok, short_bias, seed)
            if text is not None:
                finished += 1
                _validator(schema).validate(json.loads(text))
    assert finished == 2 * len(SAMPLED)  # every sampled row wrote a whole value both ways


def test_auto_takes_guidance_for_what_xgrammar_drops_and_names_both_refusals(managers):
    """"auto": xgrammar where it keeps the schema, guidance where xgrammar would drop a keyword, and a
    refusal naming the keyword from both where neither keeps it."""
    auto = managers["auto"]
    for name, schema, _, xgr_refusal, guidance_refusal in TABLE:
        if xgr_refusal is None:
            assert auto.compile(S(json=schema)).result().backend == "xgrammar", name
        elif guidance_refusal is None:
            assert auto.compile(S(json=schema)).result().backend == "guidance", name
    with pytest.raises(GrammarError) as e:
        auto.compile(S(json={"type": "integer", "not": {"const": 3}})).result()
    assert str(e.value) == ('cannot compile the JSON schema: xgrammar does not enforce not (at #); '
                            'guidance: Unimplemented keys: ["not"]')
    with pytest.raises(GrammarError) as e:
        managers["xgrammar"].compile(S(json={"type": "array", "items": {"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": True}}}})).result()
    assert str(e.value) == ("cannot compile the JSON schema: xgrammar does not enforce uniqueItems "
                            "(at #/items/properties/tags)")


def test_what_xgrammar_keeps_is_not_flagged():
    """Keywords xgrammar enforces stay with it: pydantic's shapes (``$ref`` with a description,
    ``anyOf`` with null, ``$defs``), formats it checks whole, unknown formats (free text by the
    specification), typed bounds and keywords beside a ``type`` list."""
    keeps = [{"type": "object", "properties": {"a": {"$ref": "#/$defs/A", "description": "x"},
                                               "b": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
              "$defs": {"A": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}},
             {"type": "string", "format": "password"}, {"type": "string", "format": "ipv6"},
             {"type": ["string", "null"], "maxLength": 2}, {"type": "object", "propertyNames": {"pattern": "^a"}},
             {"properties": {"a": INT}, "required": ["a"]}, {"items": INT, "minItems": 1},
             {"type": "object", "anyOf": [{"type": "object", "properties": {"k": INT}}]}]
    assert [xgrammar_unsupported(s) for s in keeps] == [None] * len(keeps)
    assert xgrammar_unsupported({"type": "object", "properties": {"not": INT}}) is None  # a property named "not"
