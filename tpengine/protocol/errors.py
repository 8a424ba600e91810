"""Pydantic ``ValidationError`` -> today's ``(field path, message)`` problems of one request."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError


def field_path(loc: Sequence[str | int]) -> str | None:
    """A pydantic ``loc`` as a field path: ``("body", "messages", 0, "role")`` ->
    ``"body.messages[0].role"``; the empty loc (the object as a whole) -> None."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + part
    return path or None


def field_errors(error: ValidationError) -> list[tuple[str | None, str]]:
    """One ``(field path, message)`` per problem, in pydantic's order (field errors, then
    cross-field ones). Messages are the models' own ("must be an integer >= 1, got 0",
    "unknown field; valid: ..."); any other pydantic error keeps pydantic's message."""
    return [(field_path(e["loc"]), e["msg"]) for e in error.errors(include_url=False)]
