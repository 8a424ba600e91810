"""The request fields that constrain the output (structured outputs), in every form clients send
them: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object and the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
fields. A request gives at most one of them; each becomes one
:class:`~tpengine.structured.StructuredOutputsParams`.

Whether a schema, regex or grammar compiles is the grammar library's to say (the server asks it
before answering, the batch job's record says it); these models check shapes and types only.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal

import annotated_types as at
from pydantic import Strict

from tpengine.protocol.base import Problem, ProtocolModel
from tpengine.protocol.fields import Flag, Neutral, NonEmptyStr, Valid, as_json
from tpengine.structured.params import StructuredOutputsParams

_Object = Annotated[dict[str, Any], Strict()]
_Bool = Annotated[bool, Strict()]
_Schema = Annotated[_Object | _Bool, Valid("a JSON schema (an object)")]
_SchemaOrText = Annotated[_Object | _Bool | Annotated[str, Strict()],
                          Valid("a JSON schema (an object, or its JSON text)")]
_Choices = Annotated[list[Annotated[str, Strict()]], Strict(), at.MinLen(1), Valid("a non-empty list of strings")]
_Unsupported = Annotated[Any, Neutral((None,), "not supported by tpengine; leave it out")]

with warnings.catch_warnings():  # the JSON names "json" and "schema" shadow BaseModel's deprecated methods
    warnings.filterwarnings("ignore", message='Field name "(json|schema)"')

    class StructuredOutputsBody(ProtocolModel):
        """vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema, or its JSON text),
        ``regex``, ``choice`` (a non-empty list of strings), ``grammar`` (EBNF or Lark text),
        ``json_object`` (true); ``disable_any_whitespace`` (default false). vLLM's
        ``whitespace_pattern`` and ``structural_tag`` are not supported; ``disable_fallback`` and
        ``disable_additional_properties`` only at false."""

        json: _SchemaOrText | None = None
        regex: NonEmptyStr | None = None
        choice: _Choices | None = None
        grammar: NonEmptyStr | None = None
        json_object: Flag | None = None
        disable_any_whitespace: Flag | None = None
        disable_fallback: Annotated[bool, Strict(), Neutral((False,))] | None = None
        disable_additional_properties: Annotated[bool, Strict(), Neutral((False,))] | None = None
        whitespace_pattern: _Unsupported = None
        structural_tag: _Unsupported = None

        KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

        @classmethod
        def problems(cls, data: dict[str, Any]) -> list[Problem]:
            given = [k for k in cls.KINDS if data.get(k) is not None and data.get(k) is not False]
            if len(given) != 1:
                got = f", got {', '.join(given)}" if given else ", got none"
                return [((), f"needs exactly one of {', '.join(cls.KINDS)}{got}")]
            return []

        def params(self) -> StructuredOutputsParams:
            """Raises ValueError: a ``json`` text that is not JSON."""
            return StructuredOutputsParams(json=self.json, regex=self.regex,
                                           choice=None if self.choice is None else tuple(self.choice),
                                           grammar=self.grammar, json_object=self.json_object or None,
                                           disable_any_whitespace=bool(self.disable_any_whitespace))

    class JsonSchemaFormat(ProtocolModel):
        """OpenAI's ``response_format.json_schema``: ``name`` (required), ``schema``, ``description``,
        ``strict`` (accepted; the output always follows the schema)."""

        MISSING: ClassVar[dict[str, str]] = {"name": "is required: must be a non-empty string",
                                             "schema": "is required: the JSON schema the output must follow"}

        name: NonEmptyStr
        schema: _Schema
        description: Annotated[str, Strict(), Valid("a string")] | None = None
        strict: Flag | None = None


class ResponseFormat(ProtocolModel):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
    (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", ...}}``."""

    MISSING: ClassVar[dict[str, str]] = {"type": 'is required: "text", "json_object" or "json_schema"'}

    type: Annotated[Literal["text", "json_object", "json_schema"], Valid('"text", "json_object" or "json_schema"')]
    json_schema: JsonSchemaFormat | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        if data.get("type") == "json_schema" and data.get("json_schema") is None:
            return [(("json_schema",), 'is required with "type": "json_schema"')]
        if data.get("type") in ("text", "json_object") and data.get("json_schema") is not None:
            return [(("json_schema",), f'goes only with "type": "json_schema", got "type": {as_json(data["type"])}')]
        return []

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema)
        return None


class StructuredFields(ProtocolModel):
    """The output constraints a request may carry, at most one of: ``response_format`` (OpenAI's;
    ``{"type": "text"}`` is none), ``structured_outputs`` (vLLM's), ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older names)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: _SchemaOrText | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: _Choices | None = None
    guided_grammar: NonEmptyStr | None = None

    STRUCTURED_KEYS: ClassVar[tuple[str, ...]] = ("response_format", "structured_outputs", "guided_json",
                                                  "guided_regex", "guided_choice", "guided_grammar")

    @classmethod
    def structured_problems(cls, data: dict[str, Any]) -> list[Problem]:
        """More than one constraint given."""
        given = [k for k in cls.STRUCTURED_KEYS if data.get(k) is not None
                 and not (k == "response_format" and isinstance(data[k], dict) and data[k].get("type") == "text")]
        if len(given) > 1:
            return [((given[1],), f"only one output constraint may be given, got {', '.join(given)}")]
        return []

    @property
    def structured_field(self) -> str | None:
        """The field that carries the constraint (for error messages), None without one."""
        for k in self.STRUCTURED_KEYS:
            v = getattr(self, k)
            if v is not None and not (k == "response_format" and v.type == "text"):
                return k
        return None

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's constraint, None without one.

        Raises:
            ValueError: a ``json`` text that is not JSON (naming it).
        """
        field = self.structured_field
        if field is None:
            return None
        if field in ("response_format", "structured_outputs"):
            return getattr(self, field).params()
        kind = field.removeprefix("guided_")
        value = getattr(self, field)
        return StructuredOutputsParams(**{kind: tuple(value) if kind == "choice" else value})
