"""What one request's output must match: vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The values of ``EngineConfig.structured_outputs_backend`` (vLLM's ``structured_outputs_config.backend``):
#: "auto" tries xgrammar and falls back to guidance for what xgrammar cannot compile.
STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance")
#: The constraint fields, of which a request sets exactly one (vLLM's names).
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text, enforced token by token with a grammar library
    (:mod:`tpengine.structured.backends`): exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it;
    * ``regex``: the output matches the regular expression as a whole;
    * ``choice``: the output is exactly one of these strings;
    * ``grammar``: a context-free grammar: EBNF (GBNF, xgrammar's) or Lark (llguidance's);
    * ``json_object``: True: the output is any JSON object (OpenAI's ``json_object`` mode).

    ``disable_any_whitespace``: JSON without free whitespace between tokens (vLLM's; default False
    lets the model put whitespace where JSON allows it).

    Raises:
        ValueError: none or several constraints given, or one of the wrong type (a ``json`` text that
            is not JSON, an empty ``choice``); the message names the field.
    """

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json_object is False:  # vLLM's "not asked"
            object.__setattr__(self, "json_object", None)
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            got = f", got {', '.join(given)}" if given else ", got none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}{got}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not a JSON schema: invalid JSON: {e.msg} at "
                                 f"column {e.colno}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {self.json!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got "
                                 f"{list(self.choice)!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object must be true when given, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as one string: the schema's JSON (keys in the order given: a JSON
        schema's property order is the order the output writes them), the regex, the choices as a
        JSON list, the grammar text ("" for json_object)."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        """The compile cache key: (kind, spec, disable_any_whitespace)."""
        return self.kind, self.spec, self.disable_any_whitespace
