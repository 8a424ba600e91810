"""Chat messages and their content parts (OpenAI ``/v1/chat/completions`` ``messages``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import annotated_types as at
from pydantic import GetCoreSchemaHandler, Strict, TypeAdapter, ValidationError
from pydantic_core import core_schema

from tpengine.protocol.base import ProtocolModel
from tpengine.protocol.fields import NonEmptyStr, Valid, as_json, invalid

#: vLLM and llama.cpp join the text parts of one message with a newline.
PART_SEPARATOR = "\n"


class TextContentPart(ProtocolModel):
    """``{"type": "text", "text": str}``; tpengine serves text only (no image or audio parts)."""

    type: Annotated[Literal["text"], Valid('"text" (tpengine serves text only)')]
    text: Annotated[str, Strict(), Valid("a string")]


_PARTS = TypeAdapter(list[TextContentPart])
_CONTENT_VALID = "a string (or a list of text parts)"


class _Content:
    """A string, or a list of text parts whose errors name the part (``content[1].type``)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def wrap(v: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> Any:
            if isinstance(v, list):
                return _PARTS.validate_python(v)  # its errors keep their place in the list
            try:
                return inner(v)
            except ValidationError:
                raise invalid(f"must be {_CONTENT_VALID}, got {as_json(v)}") from None

        return core_schema.no_info_wrap_validator_function(wrap, handler(source))


Content = Annotated[Annotated[str, Strict()] | list[TextContentPart], _Content()]


class ChatMessage(ProtocolModel):
    """One chat message: ``role`` (a non-empty string: "system", "user", "assistant", ...),
    ``content`` (a string or a list of text parts), optional ``name``."""

    MISSING: ClassVar[dict[str, str]] = {"role": "is required: must be a non-empty string",
                                         "content": f"is required: must be {_CONTENT_VALID}"}
    OBJECT: ClassVar[str] = 'an object with "role" and "content"'

    role: NonEmptyStr
    content: Content
    name: Annotated[str, Strict(), Valid("a string")] | None = None

    def text(self) -> str:
        """The content as one string: text parts joined with :data:`PART_SEPARATOR`."""
        if isinstance(self.content, str):
            return self.content
        return PART_SEPARATOR.join(p.text for p in self.content)

    def to_template(self) -> dict[str, str]:
        """The message as the chat template takes it: ``{"role", "content"[, "name"]}``."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


#: A non-empty list of messages; an error inside one message names it (``messages[0].role``).
Messages = Annotated[list[ChatMessage], Strict(), at.MinLen(1),
                     Valid('a non-empty list of {"role", "content"} objects', nested=True)]
