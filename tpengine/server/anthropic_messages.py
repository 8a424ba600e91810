"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API as vLLM and
llama-server serve it, over the chat completions path (:mod:`tpengine.server.chat_bridge`).

A request becomes a chat body: ``system`` a system message; each turn's text blocks one message
(joined with "\\n"); an assistant's ``tool_use`` blocks its ``tool_calls`` (``input`` as the JSON
arguments), a user's ``tool_result`` blocks ``tool`` messages (before the turn's text); a last
assistant turn is continued (Anthropic's prefill: ``continue_final_message``); ``max_tokens``,
``stop_sequences`` (``stop``), ``temperature``, ``top_p``, ``top_k`` the chat ones,
``output_config.format`` the ``response_format``; ``tools``
function tools (``input_schema`` the parameters); ``tool_choice`` "auto" (the default with tools),
"any" ("required"), "tool" (a named function), "none", ``disable_parallel_tool_use``
(``parallel_tool_calls`` false). As in vLLM, "auto" needs ``--enable-auto-tool-choice`` and
``--tool-call-parser`` (else a 400 naming them); "any" and "tool" constrain the output whatever the
flags.

The chat result becomes the message: a ``thinking`` block (with ``--reasoning-parser``), a ``text``
block, a ``tool_use`` block per call; ``stop_reason`` "end_turn", "max_tokens", "stop_sequence"
(``stop_sequence`` the one matched) or "tool_use". Streamed, the events are Anthropic's:
``message_start``; per block ``content_block_start``, its ``content_block_delta`` events
(``text_delta``, ``thinking_delta``, or a call's ``input_json_delta`` with its input whole),
``content_block_stop``; ``message_delta`` with ``stop_reason`` and ``usage``; ``message_stop``. Every
error is Anthropic's error object (:class:`~tpengine.protocol.anthropic.ErrorBody`), in a stream an
``error`` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpengine.protocol.anthropic import (
    CountTokensRequest,
    ErrorBody,
    ErrorDetail,
    MessageOut,
    MessagesRequest,
    TextBlock,
    TextOut,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
    blocks_text,
)
from tpengine.server.app import ServerState, _json
from tpengine.server.chat_bridge import (
    ChatCall,
    ChatEventWriter,
    chat_param_as,
    matched_stop,
    prepare_chat,
    renamed,
    start_chat,
)
from tpengine.server.serving import HTTPProblem, check_model, validate_body

#: Anthropic's error ``type`` by HTTP status (5xx other than these: "api_error").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
#: A chat finish reason -> Anthropic's ``stop_reason`` (a matched stop string: "stop_sequence").
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: HTTPProblem) -> dict[str, Any]:
    """Anthropic's error object of ``e`` (its message names the field at fault)."""
    message = e.message if e.param is None or e.message.startswith(e.param) else f"{e.param}: {e.message}"
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return ErrorBody(error=ErrorDetail(type=kind, message=message)).model_dump()


def error_response(e: HTTPProblem) -> JSONResponse:
    """``e`` as an HTTP response in Anthropic's shape."""
    return JSONResponse(error_body(e), status_code=e.status)


# --- request -> chat --------------------------------------------------------------------------
def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of ``body`` (see the module)."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": blocks_text(body.system)})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
            b.input, ensure_ascii=False)}} for b in m.content if isinstance(b, ToolUseBlock)]
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": "" if b.content is None else blocks_text(b.content)})
        if m.role == "assistant" and (texts or calls):
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif m.role == "user" and texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {k: v for k, v in {
        "name": t.name, "description": t.description, "parameters": t.input_schema}.items() if v is not None}}
        for t in body.tools or []]


def chat_body(body: MessagesRequest) -> dict[str, Any]:
    """The chat completions body of ``body`` (see the module)."""
    messages = chat_messages(body)
    chat: dict[str, Any] = {"messages": messages, "max_tokens": body.max_tokens, "stream": bool(body.stream)}
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False  # Anthropic's prefill
    if body.model is not None:
        chat["model"] = body.model
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.stop_sequences:
        chat["stop"] = list(body.stop_sequences)
    for k in ("temperature", "top_p", "top_k"):
        if (v := getattr(body, k)) is not None:
            chat[k] = v
    if body.output_config is not None and body.output_config.format is not None:
        schema = body.output_config.format.schema
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if body.tools:
        chat["tools"] = _tools(body)
        choice = body.tool_choice
        kind = "auto" if choice is None else choice.type
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": choice.name}}
        if choice is not None and choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat


def messages_param(param: str) -> str:
    """A chat body's field path as the Messages request names it (a message's index differs: the
    chat conversation has the system message and the tool results as messages of their own)."""
    return chat_param_as(param, MESSAGES_NAMES, lambda p: p.replace(".function.parameters", ".input_schema")
                         .replace(".function.", "."))


#: chat body field -> the Messages request's
MESSAGES_NAMES = {"messages": "messages", "stop": "stop_sequences", "response_format": "output_config.format"}


# --- chat -> message --------------------------------------------------------------------------
def content_blocks(message: dict[str, Any]) -> list[TextOut | ThinkingOut | ToolUseOut]:
    """The content blocks of a chat response message: its thought, its text, its calls."""
    blocks: list[TextOut | ThinkingOut | ToolUseOut] = []
    if message.get("reasoning_content"):
        blocks.append(ThinkingOut(thinking=message["reasoning_content"]))
    if message.get("content"):
        blocks.append(TextOut(text=message["content"]))
    for call in message.get("tool_calls") or []:
        blocks.append(ToolUseOut(id=call["id"], name=call["function"]["name"],
                                 input=json.loads(call["function"]["arguments"])))
    return blocks


def stop_of(finish_reason: str | None, stop: str | None) -> tuple[str | None, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat finish reason and the stop string matched."""
    if stop is not None:
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason or ""), None


def usage_of(chat_usage: dict[str, Any]) -> Usage:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Usage(input_tokens=chat_usage["prompt_tokens"], output_tokens=chat_usage["completion_tokens"],
                 cache_read_input_tokens=cached)


class EventWriter(ChatEventWriter):
    """Turns a streamed chat request's chunks into Anthropic's events (see the module)."""

    THOUGHT, TEXT = "thinking", "text"

    def __init__(self) -> None:
        super().__init__()
        self.index = -1  # the current block's index
        self.open: str | None = None  # "text" | "thinking": the block whose text is streaming

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        """One server-sent event: ``event: <kind>`` and its data (``type`` first)."""
        data = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def close(self) -> list[str]:
        """Stop the open text or thinking block."""
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.index)]

    def delta(self, kind: str, text: str) -> list[str]:
        """A ``text`` or ``thinking`` delta, starting its block first when needed."""
        out: list[str] = []
        if self.open != kind:
            out = self.close()
            self.index += 1
            self.open = kind
            block = ThinkingOut(thinking="") if kind == "thinking" else TextOut(text="")
            out.append(self.event("content_block_start", index=self.index, content_block=block.model_dump()))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        out.append(self.event("content_block_delta", index=self.index, delta=delta))
        return out

    def calls(self, calls: list[dict[str, Any]]) -> list[str]:
        """One ``tool_use`` block per call, its input in one ``input_json_delta``."""
        out = self.close()
        for call in calls:
            self.index += 1
            block = ToolUseOut(id=call["id"], name=call["function"]["name"], input={})
            out += [self.event("content_block_start", index=self.index, content_block=block.model_dump()),
                    self.event("content_block_delta", index=self.index,
                               delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                    self.event("content_block_stop", index=self.index)]
        return out



# --- the routes -------------------------------------------------------------------------------
def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

    def stops(call: ChatCall) -> str | None:
        return None if call.final is None else matched_stop(state.tokenizer, call.final, call.prepared.params.stop)

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        try:
            body = validate_body(MessagesRequest, _json(await request.body()))
            check_model(body.model, state.model_name)
            try:
                call = await start_chat(state, chat_body(body), request)
            except HTTPProblem as e:
                raise renamed(e, messages_param) from None
        except HTTPProblem as e:
            return error_response(e)
        mid = f"msg_{call.prepared.request_id.split('-', 1)[1]}"
        if body.stream:
            return StreamingResponse(_stream(call, mid), media_type="text/event-stream")
        try:
            chat = await call.result(request)
        except HTTPProblem as e:
            return error_response(renamed(e, messages_param))
        if chat is None:
            return Response(status_code=499)
        choice = chat["choices"][0]
        reason, stop = stop_of(choice["finish_reason"], stops(call))
        msg = MessageOut(id=mid, content=content_blocks(choice["message"]), model=state.model_name,
                         stop_reason=reason, stop_sequence=stop, usage=usage_of(chat["usage"]))
        return JSONResponse(msg.model_dump())

    async def _stream(call: ChatCall, mid: str) -> AsyncIterator[str]:
        w = EventWriter()
        start = MessageOut(id=mid, content=[], model=state.model_name,
                           usage=Usage(input_tokens=len(call.prepared.prompt_ids[0]), output_tokens=0))
        yield w.event("message_start", message=start.model_dump())
        def failed(err: dict[str, Any]) -> list[str]:
            problem = HTTPProblem(err.get("code") or 500, err["message"])
            return [w.event("error", error=error_body(problem)["error"])]

        async for event in w.events(call, failed):
            yield event
        if w.failed:
            return
        reason, stop = stop_of(w.finish, stops(call))
        usage = usage_of(w.usage).model_dump() if w.usage else {"output_tokens": 0}
        yield w.event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop}, usage=usage)
        yield w.event("message_stop")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            body = validate_body(CountTokensRequest, _json(await request.body()))
            check_model(body.model, state.model_name)
            chat: dict[str, Any] = {"messages": chat_messages(body), "max_tokens": 1}
            if body.tools:  # the template sees the tools; no choice constrains anything here
                chat["tools"], chat["tool_choice"] = _tools(body), "none"
            try:
                p = await asyncio.to_thread(prepare_chat, state, chat)
            except HTTPProblem as e:
                raise renamed(e, messages_param) from None
        except HTTPProblem as e:
            return error_response(e)
        return JSONResponse({"input_tokens": len(p.prompt_ids[0])})
