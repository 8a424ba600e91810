"""Tool calling in a chat request (OpenAI's shapes): ``tools``, ``tool_choice``,
``parallel_tool_calls``, and the ``tool_calls`` of an assistant message in the history."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Strict

from tpengine.protocol.base import Problem, ProtocolModel
from tpengine.protocol.fields import Flag, NonEmptyStr, Valid, as_json

_Str = Annotated[str, Strict(), Valid("a string")]
_Function = Annotated[Literal["function"], Valid('"function"')]


class FunctionDefinition(ProtocolModel):
    """A function the model may call: ``name``, ``description``, ``parameters`` (a JSON schema of
    its arguments; absent: none), ``strict`` (accepted; ``required`` and named choices always follow
    the schema)."""

    name: NonEmptyStr
    description: _Str | None = None
    parameters: Annotated[dict[str, Any], Strict(), Valid("a JSON schema (an object)")] | None = None
    strict: Flag | None = None


class Tool(ProtocolModel):
    """``{"type": "function", "function": {...}}``."""

    type: _Function
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape, unset fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(ProtocolModel):
    name: NonEmptyStr


class NamedToolChoice(ProtocolModel):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    type: _Function
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                       Valid('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                             nested=True)]


_Arguments = Annotated[Annotated[str, Strict()] | Annotated[dict[str, Any], Strict()] | Annotated[list[Any], Strict()],
                       Valid("JSON text, an object or an array")]


class ToolCallFunction(ProtocolModel):
    """A history call's function: ``name`` and ``arguments``: JSON text (OpenAI's), an object or an
    array (what some clients send back), or absent / ``null`` / ``""`` (none)."""

    name: NonEmptyStr
    arguments: _Arguments | None = None


class ToolCall(ProtocolModel):
    """A call in an assistant message of the history: ``id``, ``type`` "function", ``function``
    ``{"name", "arguments"}`` (arguments as JSON text)."""

    id: _Str | None = None
    type: _Function | None = None
    function: ToolCallFunction

    def to_template(self) -> dict[str, Any]:
        """The call as chat templates read it (Qwen's and Llama's templates write ``arguments |
        tojson``), as vLLM's ``_postprocess_messages`` passes it: JSON text decoded (``"null"`` to
        ``{}``), an object or array as given, and empty arguments (absent, ``null``, ``""``, ``{}``,
        ``[]``) as ``{}``. Text that is not JSON stays text (vLLM fails the request on it; a history
        turn it cannot read would fail every later turn too)."""
        args: Any = self.function.arguments
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                pass
            else:
                args = {} if args is None else args
        if not args:
            args = {}
        out: dict[str, Any] = {"type": "function", "function": {"name": self.function.name, "arguments": args}}
        if self.id is not None:
            out["id"] = self.id
        return out


class ToolFields(ProtocolModel):
    """A chat request's tools: ``tools`` (a list of functions; ``[]`` is none), ``tool_choice`` ("none", "auto" (the
    default with tools), "required", or a named function, which must be one of ``tools``),
    ``parallel_tool_calls`` (default true: several calls in one answer)."""

    tools: Annotated[list[Tool], Strict(), Valid("a list of tools", nested=True)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Flag | None = None

    TOOL_KEYS: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "parallel_tool_calls")

    @classmethod
    def tool_problems(cls, data: dict[str, Any]) -> list[Problem]:
        """A required or named ``tool_choice`` without ``tools``; a named one that is not in them."""
        choice, tools = data.get("tool_choice"), data.get("tools")
        names = [t["function"].get("name") for t in tools if isinstance(t, dict)
                 and isinstance(t.get("function"), dict)] if isinstance(tools, list) else []
        if choice is None or choice in ("none", "auto"):
            return []
        if not tools:
            return [(("tool_choice",), f"needs tools to choose from, got tool_choice {as_json(choice)} and no tools")]
        if choice == "required":
            return cls._defs_problems(tools)
        if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            if isinstance(name, str) and name not in names:
                return [(("tool_choice", "function", "name"), f"names no tool of this request: got {as_json(name)}, "
                         f"the tools are {', '.join(as_json(n) for n in names)}")]
        return []

    @staticmethod
    def _defs_problems(tools: list[Any]) -> list[Problem]:
        """``required`` joins every tool's ``parameters`` into one schema with their ``$defs`` (and
        ``definitions``) at its root, where their ``$ref``s point: a name two tools define differently is
        refused (vLLM's rule and words)."""
        seen: dict[tuple[str, str], Any] = {}
        for i, t in enumerate(tools):
            params = t.get("function", {}).get("parameters") if isinstance(t, dict) and isinstance(
                t.get("function"), dict) else None
            for key in ("$defs", "definitions"):
                defs = params.get(key) if isinstance(params, dict) else None
                for name, sub in defs.items() if isinstance(defs, dict) else ():
                    if seen.setdefault((key, name), sub) != sub:
                        return [(("tools", i, "function", "parameters", key, name),
                                 f"Tool definition {name!r} has multiple schemas, which is not supported")]
        return []

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (``tool_choice`` with its default)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None or self.tool_choice == "auto":
            return "auto"
        return "required" if self.tool_choice == "required" else "named"
