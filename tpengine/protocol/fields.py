"""Field types of the request models: JSON-strict types whose errors say what is valid.

Each type is ``Annotated[<strict pydantic type>, Valid(...)]``: the strict type gives the JSON
schema (``type``, ``minimum``, ...) and the validation; :class:`Valid` turns any failure into one
error ``"must be <valid>, got <the value as JSON>"`` at the field itself (so a server's 400 and
the batch job's error records say the same thing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import Field, GetCoreSchemaHandler, Strict, ValidationError
from pydantic_core import PydanticCustomError, core_schema

from tpengine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

#: Longest rendering of a bad value in a message (long prompts and id lists are cut).
MAX_GOT_CHARS = 60


def as_json(v: Any) -> str:
    """``v`` as JSON for a message (``true``, ``"GET"``, ``NaN``), cut to ``MAX_GOT_CHARS``."""
    try:
        s = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= MAX_GOT_CHARS else s[: MAX_GOT_CHARS - 3] + "..."


def invalid(message: str, kind: str = "invalid_value") -> PydanticCustomError:
    """A pydantic error carrying ``message`` verbatim (braces in it are not a template)."""
    return PydanticCustomError(kind, "{message}", {"message": message})


@dataclass(frozen=True)
class Valid:
    """Annotation marker: a value failing the annotated type gets ``"must be <valid>, got <value>"``
    (``show_got=False``: without the value).

    ``nested``: errors inside the value (a list item's field, ``messages[0].role``) are kept as
    they are, so they name the exact place; only errors of the value itself are replaced.
    ``check``: an extra test of the validated value, returning a message or None.
    """

    valid: str
    nested: bool = False
    show_got: bool = True
    check: Callable[[Any], str | None] | None = None

    def message(self, v: Any) -> str:
        return f"must be {self.valid}" + (f", got {as_json(v)}" if self.show_got else "")

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def wrap(v: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> Any:
            try:
                out = inner(v)
            except ValidationError as e:
                if self.nested and all(err["loc"] for err in e.errors()):
                    raise
                raise invalid(self.message(v)) from None
            if self.check is not None and (msg := self.check(out)) is not None:
                raise invalid(msg)
            return out

        return core_schema.no_info_wrap_validator_function(wrap, handler(source))


@dataclass(frozen=True, eq=False)  # values may hold dicts: hash by identity
class Neutral:
    """Annotation marker of an OpenAI field tpengine does not implement: only ``values`` are accepted,
    compared after the annotated strict type has validated the value (so ``0`` is not ``false``
    and ``true`` is not ``1``); ``null`` is "not given" when the field is optional.
    ``message``: the whole error text; default ``"not supported by tpengine; only <values>, got <v>"``.
    """

    values: tuple[Any, ...] = ()
    message: str | None = None

    def text(self, v: Any) -> str:
        if self.message is not None:
            return f"{self.message}, got {as_json(v)}"
        only = " or ".join(as_json(x) for x in self.values) if self.values else "null"
        return f"not supported by tpengine; only {only}, got {as_json(v)}"

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def wrap(v: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> Any:
            try:
                out = inner(v)  # the strict type first: 0 is no bool, true no int
            except ValidationError:
                raise invalid(self.text(v)) from None
            if out not in self.values:
                raise invalid(self.text(v))
            return out

        return core_schema.no_info_wrap_validator_function(wrap, handler(source))


_EMPTY_STR = 'must be a non-empty string, got ""'


def _non_empty(v: str) -> str | None:
    return "must be non-empty" if v == "" else None


# --- sampling fields (vLLM's SamplingParams names and ranges) ---------------------------------
#: ``max_tokens``: 0 scores the prompt without generating (with ``echo`` or ``prompt_logprobs``).
MaxTokens = Annotated[int, Strict(), at.Ge(0), Valid("an integer >= 0 (0: score the prompt only)")]
Temperature = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False), Valid("a number >= 0")]
TopP = Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False), Valid("a number in (0, 1]")]
TopK = Annotated[int, Strict(), at.Ge(-1), Valid("an integer >= -1 (0 or -1: disabled)")]
MinP = Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False), Valid("a number in [0, 1]")]
Seed = Annotated[int, Strict(), at.Ge(-(2**63)), at.Lt(2**64), Valid("an integer in [-2**63, 2**64)")]
Stop = Annotated[Annotated[str, Strict(), at.MinLen(1)] | list[Annotated[str, Strict(), at.MinLen(1)]],
                 Valid("a non-empty string or a list of non-empty strings")]
Flag = Annotated[bool, Strict(), Valid("true or false")]
N = Annotated[int, Strict(), at.Ge(1), Valid("an integer >= 1")]
Penalty = Annotated[float, Strict(), Field(ge=-2, le=2, allow_inf_nan=False), Valid("a number in [-2, 2]")]
RepetitionPenalty = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False), Valid("a number > 0")]
MinTokens = Annotated[int, Strict(), at.Ge(0), Valid("an integer >= 0")]
StopTokenIds = Annotated[list[Annotated[int, Strict(), at.Ge(0)]], Strict(),
                         Valid("a list of integer token ids >= 0")]
#: ``logprobs`` / ``prompt_logprobs`` / ``top_logprobs``: how many top tokens per position.
NumLogprobs = Annotated[int, Strict(), at.Ge(0), at.Le(MAX_LOGPROBS),
                        Valid(f"an integer in [0, {MAX_LOGPROBS}]")]


def _logit_bias(v: dict[str, float]) -> str | None:
    for k, b in v.items():
        if not k.isdecimal() or not k.isascii():
            return f"must have token-id keys (decimal integer strings such as \"123\"), got key {as_json(k)}"
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            return f"must have values in [-100, 100], got {as_json(b)} for token {k}"
    return None


#: ``logit_bias``: ``{"<token id>": bias}``; JSON keys are strings, so a token id is a decimal string.
LogitBias = Annotated[dict[str, Annotated[float, Strict(), Field(allow_inf_nan=False)]], Strict(),
                      Valid('an object of token id -> number in [-100, 100] (e.g. {"123": -100})',
                            check=_logit_bias)]
ChatTemplateKwargs = Annotated[dict[str, Any], Strict(), Valid("an object")]

# --- prompts ---------------------------------------------------------------------------------
TokenIds = Annotated[list[Annotated[int, Strict(), at.Ge(0)]], Strict(), at.MinLen(1),
                     Valid("a list of token ids (a non-empty list of integer token ids >= 0)")]
NonEmptyStr = Annotated[str, Strict(), Valid("a non-empty string", check=lambda v: None if v else _EMPTY_STR)]


#: The message for several prompts in one batch line.
PROMPT_LIST_ERROR = ("a batch line holds one prompt (send one line per prompt, so that each gets its own record, "
                     "id and --resume entry)")


def _one_prompt(v: str | list) -> str | None:
    if isinstance(v, str):
        return _non_empty(v)
    if not v:
        return "must be a non-empty string or a non-empty list, got []"
    if isinstance(v[0], str) and len(v) > 1:
        return f"{PROMPT_LIST_ERROR}, got a list of {len(v)} prompts"
    return None


#: A simple line's prompt: a string, a list of token ids, or a list holding one string (OpenAI's
#: batched form with a single prompt). Several prompts in one line are refused by name.
Prompt = Annotated[
    Annotated[str, Strict()] | list[Annotated[int, Strict(), at.Ge(0)]] | list[Annotated[str, Strict(), at.MinLen(1)]],
    Valid("a non-empty string (or a list of integer token ids >= 0, or a list holding one non-empty string)",
          check=_one_prompt),
]


def _prompts(v: str | list) -> str | None:
    if isinstance(v, str):
        return _non_empty(v)
    if not v:
        return "must be a non-empty string or a non-empty list, got []"
    if isinstance(v[0], list) and (i := next((i for i, ids in enumerate(v) if not ids), None)) is not None:
        return f"must hold non-empty lists of token ids, got [] at index {i}"
    return None


#: An OpenAI completions ``prompt``: a string, a list of strings, a list of token ids, or a list of
#: token-id lists (OpenAI's four forms); each list entry is one prompt of its own.
Prompts = Annotated[
    Annotated[str, Strict()] | list[Annotated[int, Strict(), at.Ge(0)]]
    | list[Annotated[str, Strict(), at.MinLen(1)]] | list[list[Annotated[int, Strict(), at.Ge(0)]]],
    Valid("a non-empty string, a list of non-empty strings, a list of integer token ids >= 0, or a list of "
          "such lists", check=_prompts),
]

#: A simple line's ``id``: a non-empty string, or an integer (turned into its decimal string).
RequestId = Annotated[Annotated[str, Strict()] | Annotated[int, Strict()],
                      Valid("a non-empty string or an integer",
                            check=lambda v: 'must be a non-empty string or an integer, got ""' if v == "" else None)]

Method = Annotated[Literal["POST"], Valid('"POST"')]
ChatURL = "/v1/chat/completions"
CompletionURL = "/v1/completions"
URL = Annotated[Literal["/v1/chat/completions", "/v1/completions"],
                Valid(f"one of {ChatURL}, {CompletionURL}")]
