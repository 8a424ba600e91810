"""Chat messages and their content parts (OpenAI ``/v1/chat/completions`` ``messages``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import annotated_types as at
from pydantic import GetCoreSchemaHandler, Strict, TypeAdapter, ValidationError
from pydantic_core import core_schema

from tpengine.protocol.base import Problem, ProtocolModel
from tpengine.protocol.fields import NonEmptyStr, Valid, as_json, invalid
from tpengine.protocol.tools import ToolCall

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
        def wrap(v: Any, inner: core_schema.ValidatorFunctionWrapHandler, info: core_schema.ValidationInfo) -> Any:
            if isinstance(v, list):  # its errors keep their place in the list; lenient mode reaches the parts
                return _PARTS.validate_python(v, context=info.context)
            try:
                return inner(v)
            except ValidationError:
                raise invalid(f"must be {_CONTENT_VALID}, got {as_json(v)}") from None

        return core_schema.with_info_wrap_validator_function(wrap, handler(source))


Content = Annotated[Annotated[str, Strict()] | list[TextContentPart], _Content()]


class ChatMessage(ProtocolModel):
    """One chat message: ``role`` (a non-empty string: "system", "user", "assistant", "tool", ...),
    ``content`` (a string or a list of text parts; may be null or left out in an assistant message
    with ``tool_calls``), optional ``name``; an assistant's ``tool_calls`` and a tool result's
    ``tool_call_id`` (OpenAI's tool-calling history); an assistant's earlier thought as
    ``reasoning_content`` or ``reasoning`` (vLLM's names; the template sees it under both, as vLLM
    renders it, so templates that interleave thinking, Qwen3's, put it back)."""

    MISSING: ClassVar[dict[str, str]] = {"role": "is required: must be a non-empty string",
                                         "content": f"is required: must be {_CONTENT_VALID}"}
    OBJECT: ClassVar[str] = 'an object with "role" and "content"'

    role: NonEmptyStr
    content: Content | None = None
    name: Annotated[str, Strict(), Valid("a string")] | None = None
    tool_calls: Annotated[list[ToolCall], Strict(), Valid("a list of tool calls", nested=True)] | None = None
    tool_call_id: Annotated[str, Strict(), Valid("a string")] | None = None
    reasoning_content: Annotated[str, Strict(), Valid("a string")] | None = None
    reasoning: Annotated[str, Strict(), Valid("a string")] | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        if data.get("content") is None and not (data.get("role") == "assistant" and data.get("tool_calls")):
            return [(("content",), cls.MISSING["content"] if "content" not in data else
                     f"must be {_CONTENT_VALID} (null only in an assistant message with tool_calls), got null")]
        for field in ("tool_calls", "reasoning_content", "reasoning"):
            if data.get(field) is not None and data.get("role") != "assistant":
                return [((field,), f'belongs to an "assistant" message, got role {as_json(data.get("role"))}')]
        return []

    def text(self) -> str:
        """The content as one string: text parts joined with :data:`PART_SEPARATOR` ("" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return PART_SEPARATOR.join(p.text for p in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template takes it: ``{"role", "content"[, "name"][, "tool_calls"]
        [, "tool_call_id"][, "reasoning_content", "reasoning"]}`` (a call's arguments decoded,
        :meth:`ToolCall.to_template`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:
            out["reasoning_content"] = out["reasoning"] = thought
        return out


#: A non-empty list of messages; an error inside one message names it (``messages[0].role``).
Messages = Annotated[list[ChatMessage], Strict(), at.MinLen(1),
                     Valid('a non-empty list of {"role", "content"} objects', nested=True)]


class ChatTemplateFields(ProtocolModel):
    """The chat-template options of a request with ``messages`` (vLLM's names), passed to
    ``tokenizer.apply_chat_template``: ``add_generation_prompt`` (default true: open the assistant's
    turn; false when ``continue_final_message`` is true and it is not given),
    ``continue_final_message`` (default false: true continues the last message, which must be the
    assistant's, with no end of turn: a prefilled reply), ``chat_template_kwargs`` (extra
    variables for the template, e.g. Qwen3's ``{"enable_thinking": false}``)."""

    add_generation_prompt: Annotated[bool, Strict(), Valid("true or false")] | None = None
    continue_final_message: Annotated[bool, Strict(), Valid("true or false")] | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Strict(), Valid("an object")] | None = None

    TEMPLATE_KEYS: ClassVar[tuple[str, ...]] = ("add_generation_prompt", "continue_final_message",
                                                "chat_template_kwargs")
    #: ``apply_chat_template``'s own arguments and the variables it sets itself: a
    #: ``chat_template_kwargs`` key among them is refused (naming the field to use, if any).
    RESERVED_KWARGS: ClassVar[tuple[str, ...]] = (
        "add_generation_prompt", "continue_final_message", "conversation", "messages", "tools", "documents",
        "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs")

    @classmethod
    def template_problems(cls, data: dict[str, Any], prompt_key: str | None) -> list[tuple[tuple[str, ...], str]]:
        """The options' cross-field rules on the raw object. ``prompt_key``: the prompt field given
        when it is not ``messages`` (then every option given is refused), else None."""
        out: list[tuple[tuple[str, ...], str]] = []
        if prompt_key is not None:
            for k in cls.TEMPLATE_KEYS:
                if data.get(k) is not None:
                    out.append(((k,), f'applies only to a "messages" prompt (the chat template), not to '
                                      f'"{prompt_key}"; leave it out'))
            return out
        kwargs = data.get("chat_template_kwargs")
        if isinstance(kwargs, dict):
            for k in kwargs:
                if k in cls.RESERVED_KWARGS:
                    use = f"; use the top-level {k!r} field" if k in cls.TEMPLATE_KEYS else ""
                    out.append((("chat_template_kwargs", k), f"is set by tpengine itself, not a template "
                                f"variable{use}"))
        if data.get("continue_final_message") is True:
            if data.get("add_generation_prompt") is True:
                out.append((("continue_final_message",), "cannot be true together with add_generation_prompt "
                            "true (continue the final message, or open a new assistant turn: set "
                            "add_generation_prompt false)"))
            messages = data.get("messages")
            last = messages[-1] if isinstance(messages, list) and messages else None
            if isinstance(last, dict) and isinstance(last.get("role"), str) and last["role"] != "assistant":
                out.append((("continue_final_message",), 'needs the last message to be the "assistant" message '
                            f'to continue, got role {as_json(last["role"])}'))
        return out

    def template_options(self) -> dict[str, Any]:
        """``apply_chat_template`` keyword arguments: ``add_generation_prompt``,
        ``continue_final_message`` and ``chat_template_kwargs`` (a dict, {} when not given)."""
        cont = bool(self.continue_final_message)
        add = (not cont) if self.add_generation_prompt is None else self.add_generation_prompt
        return {"add_generation_prompt": add, "continue_final_message": cont,
                "chat_template_kwargs": dict(self.chat_template_kwargs or {})}
