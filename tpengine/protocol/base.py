"""The base of every request model: unknown fields are errors naming the valid ones (or, in the
server's lenient mode, dropped and named), every problem of an object is reported at once, and
cross-field rules run even when a field is bad."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator
from pydantic_core import InitErrorDetails

from tpengine.protocol.fields import invalid

#: A problem found by a cross-field rule: (location inside the object, message).
Problem = tuple[tuple[str | int, ...], str]

#: The validation-context key of lenient mode: ``Model.model_validate(obj, context={IGNORE_UNKNOWN:
#: ignored})`` with ``ignored`` a set drops every unknown field, at any depth, instead of refusing
#: it, and adds ``(model class name, field name)`` to ``ignored`` (vLLM's server accepts and ignores
#: fields it does not know; tpengine's server does the same, a batch file does not).
IGNORE_UNKNOWN = "ignore_unknown"


class ProtocolModel(BaseModel):
    """A JSON object of the protocol (``extra="forbid"``).

    Errors (pydantic ``ValidationError`` line errors, ``loc`` relative to the object):

    * an unknown field: ``"unknown field; valid: <own fields first, then inherited>"`` (none in
      lenient mode, see :data:`IGNORE_UNKNOWN`);
    * a missing required field: ``MISSING.get(name, "is required")``;
    * a value that is not a JSON object: ``"must be <OBJECT>"``;
    * whatever :meth:`problems` returns for the raw object, together with the field errors
      (a cross-field rule is not skipped because some field is invalid).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Message for a missing required field, by field name (default "is required").
    MISSING: ClassVar[dict[str, str]] = {}
    #: What the object must be, for the message of a non-object value.
    OBJECT: ClassVar[str] = "an object"

    @classmethod
    def valid_fields(cls) -> list[str]:
        """Field names as error messages list them: the class's own first, then inherited."""
        names: list[str] = []
        for klass in cls.__mro__:
            for name in klass.__dict__.get("__annotations__", {}):
                if name in cls.model_fields and name not in names:
                    names.append(name)
        return names

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        """Cross-field rules on the raw JSON object (before field validation); none by default."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _report_all(cls, data: Any, handler: Any, info: ValidationInfo) -> Any:
        ignored = info.context.get(IGNORE_UNKNOWN) if isinstance(info.context, dict) else None
        if ignored is not None and isinstance(data, dict) and any(k not in cls.model_fields for k in data):
            ignored.update((cls.__name__, k) for k in data if k not in cls.model_fields)
            data = {k: v for k, v in data.items() if k in cls.model_fields}
        try:
            model = handler(data)
            errors: list[dict[str, Any]] = []
        except ValidationError as e:
            model, errors = None, e.errors()
        extra = cls.problems(data) if isinstance(data, dict) else []
        if not errors and not extra:
            return model
        details: list[InitErrorDetails] = []
        for err in errors:
            loc, kind, msg = tuple(err["loc"]), err["type"], err["msg"]
            if len(loc) == 1 and kind == "extra_forbidden":
                msg = f"unknown field; valid: {', '.join(cls.valid_fields())}"
            elif len(loc) == 1 and kind == "missing":
                msg = cls.MISSING.get(str(loc[0]), "is required")
            elif not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
                msg = f"must be {cls.OBJECT}"
            details.append(InitErrorDetails(type=invalid(msg, kind), loc=loc, input=err.get("input")))
        for loc, msg in extra:
            details.append(InitErrorDetails(type=invalid(msg), loc=loc, input=data))
        raise ValidationError.from_exception_data(cls.__name__, details)
