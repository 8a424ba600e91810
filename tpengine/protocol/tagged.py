"""A JSON object whose ``type`` field picks its model (the Responses API's input items and content
parts, the Messages API's content blocks): errors name the place inside the object
(``input[1].call_id``), an unknown ``type`` names the valid ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import GetCoreSchemaHandler, TypeAdapter
from pydantic_core import core_schema

from tpengine.protocol.base import ProtocolModel
from tpengine.protocol.fields import as_json, invalid


class Tagged:
    """Annotation (``Annotated[Any, Tagged(...)]``): a JSON object validated as ``models[obj["type"]]``.

    ``models``: ``type`` value -> model; ``default``: the ``type`` of an object without one (None:
    ``type`` is required); ``what``: the name of the object in messages ("an input item");
    ``refused``: ``type`` values known but not served -> the reason (e.g. "tpengine serves text only").
    Lenient mode (:data:`~tpengine.protocol.base.IGNORE_UNKNOWN`) reaches the chosen model.
    """

    def __init__(self, models: Mapping[str, type[ProtocolModel]], what: str, default: str | None = None,
                 refused: Mapping[str, str] | None = None) -> None:
        self.models, self.what, self.default, self.refused = dict(models), what, default, dict(refused or {})

    def valid_types(self) -> str:
        """The served ``type`` values, as a message lists them."""
        return ", ".join(as_json(t) for t in self.models)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(v: Any, info: core_schema.ValidationInfo) -> Any:
            if not isinstance(v, dict):
                raise invalid(f"must be {self.what} (an object with \"type\": {self.valid_types()}), got {as_json(v)}")
            kind = v.get("type", self.default)
            if kind in self.refused:
                raise invalid(f"type {as_json(kind)} is not supported: {self.refused[kind]}; "
                              f"valid: {self.valid_types()}")
            model = self.models.get(kind) if isinstance(kind, str) else None
            if model is None:
                got = "none" if kind is None else as_json(kind)
                raise invalid(f"must be {self.what} with \"type\" one of {self.valid_types()}, got type {got}")
            return model.model_validate(v, context=info.context)

        return core_schema.with_info_plain_validator_function(validate)


class StrOrList:
    """Annotation (``Annotated[Any, StrOrList(item, ...)]``): a string, or a list of ``item`` whose
    errors keep their place (``input[2].call_id``); anything else is ``"must be <valid>, got ..."``.
    ``non_empty``: "" and [] are refused too."""

    def __init__(self, item: Any, valid: str, non_empty: bool = False) -> None:
        self.item, self.valid, self.non_empty = item, valid, non_empty
        self._adapter: TypeAdapter | None = None

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(v: Any, info: core_schema.ValidationInfo) -> Any:
            if isinstance(v, (str, list)) and not (self.non_empty and not v):
                if isinstance(v, str):
                    return v
                if self._adapter is None:
                    self._adapter = TypeAdapter(list[self.item])
                return self._adapter.validate_python(v, context=info.context)
            raise invalid(f"must be {self.valid}, got {as_json(v)}")

        return core_schema.with_info_plain_validator_function(validate)
