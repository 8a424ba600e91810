"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API as vLLM serves it,
over the chat completions path (:mod:`tpengine.server.chat_bridge`).

A request becomes a chat body: ``instructions`` a system message, then the conversation of
``previous_response_id`` (its input and output, from the store), then ``input`` (a string is a
user message; ``developer`` messages are system messages; ``function_call`` items become the
assistant's ``tool_calls``, ``function_call_output`` items ``tool`` messages; ``reasoning`` items
are dropped); ``max_output_tokens`` is ``max_completion_tokens``, ``text.format`` the
``response_format``, function ``tools`` and ``tool_choice`` the chat ones. As in vLLM, ``tool_choice``
"auto" (the default) on a server without ``--enable-auto-tool-choice`` shows the tools to the chat
template and answers in text ("required" and a named function constrain the output whatever the
flags). The chat result becomes output items: a ``reasoning`` item (with ``--reasoning-parser``), a
``message`` with one ``output_text``, a ``function_call`` per call.

Streamed (``stream``: true), the events are OpenAI's: ``response.created``, ``response.in_progress``;
per output item ``response.output_item.added``, for text ``response.content_part.added``, its
``response.output_text.delta`` events, ``response.output_text.done``, ``response.content_part.done``
(for a thought the same with ``response.reasoning_text.*``), for a call
``response.function_call_arguments.delta`` (the arguments whole) and ``.done``; then
``response.output_item.done``; last ``response.completed`` with the whole response (its ``status``
"incomplete" when ``max_output_tokens`` cut it, as vLLM sends it). A failure is an ``error`` event,
then ``response.failed``.

Responses are kept (``store``, default true) in a store bounded to :data:`STORE_SIZE`, the least
recently used dropped first; ``previous_response_id`` of one that is not there is a 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpengine.protocol.responses import (
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOut,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    parts_text,
)
from tpengine.server.app import ServerState, _json, problem_response
from tpengine.server.chat_bridge import ChatCall, ChatEventWriter, chat_param_as, renamed, start_chat
from tpengine.server.serving import HTTPProblem, check_model, validate_body

#: How many responses the store keeps (the least recently used go first).
STORE_SIZE = 1024
#: The output item types of a response.
OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


@dataclass
class Stored:
    """A stored response: the ``response`` object and ``history``, the chat messages of its
    conversation through its output (``instructions`` left out: they do not carry over)."""

    response: dict[str, Any]
    history: list[dict[str, Any]]


class ResponseStore:
    """The responses kept for ``previous_response_id`` and ``GET``: at most ``capacity``, the least
    recently used (stored or read) dropped first. Used from the event loop only."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        """The stored response, or None (never stored, stored with ``store`` false, or dropped)."""
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: Stored) -> None:
        """Keep ``item``, dropping the least recently used beyond ``capacity``."""
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# --- request -> chat --------------------------------------------------------------------------
def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``body.input`` (see the module): consecutive ``function_call`` items
    join one assistant message (after its text, when an assistant message comes first)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": parts_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output)})
    return out


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]], auto_tools: bool) -> dict[str, Any]:
    """The chat completions body of ``body`` with the conversation ``messages`` (``instructions``
    go first). ``auto_tools``: the server parses "auto" tool calls (else "auto" is text)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"messages": system + messages, "stream": bool(body.stream)}
    if body.model is not None:
        chat["model"] = body.model
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    for k in ResponsesRequest.SAMPLING_KEYS:
        if (v := getattr(body, k)) is not None:
            chat[k] = v
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
        choice = body.tool_choice or "auto"
        if choice == "auto" and not auto_tools:
            choice = "none"  # vLLM's Responses API: no parser, no parsed calls; the template still sees the tools
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.text is not None and body.text.format is not None and (fmt := body.text.format.response_format()):
        chat["response_format"] = fmt
    return chat


def responses_param(param: str) -> str:
    """A chat body's field path as the Responses request names it."""
    return chat_param_as(param, RESPONSES_NAMES, lambda p: p.replace(".function.", ".", 1))


#: chat body field -> the Responses request's
RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def _problem(e: HTTPProblem) -> HTTPProblem:
    """A chat-path error in the Responses API's names."""
    out = renamed(e, responses_param)
    out.message = out.message.replace("(max_completion_tokens)", "(max_output_tokens)")
    return out


# --- chat -> response -------------------------------------------------------------------------
def _hex() -> str:
    return uuid.uuid4().hex


def output_items(message: dict[str, Any]) -> list[OutputItem]:
    """The output items of a chat response message: its thought, its text, its calls (in that order)."""
    items: list[OutputItem] = []
    if message.get("reasoning_content"):
        items.append(ReasoningOut(id=f"rs_{_hex()}", content=[ReasoningText(text=message["reasoning_content"])]))
    if message.get("content"):
        items.append(OutputMessage(id=f"msg_{_hex()}", content=[OutputText(text=message["content"])]))
    for call in message.get("tool_calls") or []:
        items.append(FunctionCallOut(id=f"fc_{_hex()}", call_id=call["id"], name=call["function"]["name"],
                                     arguments=call["function"]["arguments"]))
    return items


def history_message(items: list[OutputItem]) -> dict[str, Any]:
    """The assistant's chat message of a response's output items (what ``previous_response_id`` replays)."""
    text = "".join(c.text for i in items if isinstance(i, OutputMessage) for c in i.content)
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in items if isinstance(i, FunctionCallOut)]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def usage_of(chat_usage: dict[str, Any] | None, reasoning_tokens: int = 0) -> ResponseUsage | None:
    """The Responses usage of a chat ``usage``."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponseUsage(input_tokens=chat_usage["prompt_tokens"], input_tokens_details=InputTokensDetails(
        cached_tokens=cached), output_tokens=chat_usage["completion_tokens"], output_tokens_details=OutputTokensDetails(
        reasoning_tokens=reasoning_tokens), total_tokens=chat_usage["prompt_tokens"] + chat_usage["completion_tokens"])


def response_object(body: ResponsesRequest, response_id: str, created: int, model: str, status: str,
                    output: list[OutputItem], usage: ResponseUsage | None = None,
                    error: ResponseError | None = None) -> ResponseObject:
    """The response object of ``body`` (its settings echoed) with ``output`` and ``status``: a chat
    finish reason "length" makes it "incomplete" (see :func:`status_of`)."""
    incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    text = {"format": {"type": "text"}} if body.text is None or body.text.format is None else {
        "format": body.text.format.model_dump(exclude_none=True)}
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    return ResponseObject(
        id=response_id, created_at=created, status=status, error=error, incomplete_details=incomplete,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, max_tool_calls=body.max_tool_calls,
        metadata=body.metadata or {}, model=model, output=output,
        parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
        reasoning=None if body.reasoning is None else body.reasoning.model_dump(exclude_none=True),
        store=body.store is not False, temperature=body.temperature, text=text,
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []], top_p=body.top_p,
        truncation=body.truncation or "disabled", usage=usage, user=body.user)


def status_of(finish_reason: str | None) -> str:
    """A response's ``status`` from its chat finish reason."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


def _reasoning_tokens(tokenizer: Any, items: list[OutputItem]) -> int:
    """How many tokens the thought took (its text re-tokenized)."""
    text = "".join(c.text for i in items if isinstance(i, ReasoningOut) for c in i.content)
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


# --- streaming --------------------------------------------------------------------------------
class EventWriter(ChatEventWriter):
    """Turns a streamed chat request's chunks into the Responses events (see the module); ``items``
    are the output items so far, ``finish`` the chat finish reason, ``usage`` the chat usage."""

    THOUGHT, TEXT = "reasoning", "message"

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: str | None = None  # "reasoning" | "message": the item whose text is streaming
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: ``event: <kind>`` and its data (``type`` and ``sequence_number`` first)."""
        data = {"type": kind, "sequence_number": self.seq, **{
            k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in fields.items()}}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _item(self, kind: str) -> OutputItem:
        if kind == "reasoning":
            return ReasoningOut(id=f"rs_{_hex()}", content=[], status="in_progress")
        return OutputMessage(id=f"msg_{_hex()}", content=[], status="in_progress")

    def _part(self, text: str) -> OutputText | ReasoningText:
        return ReasoningText(text=text) if self.open == "reasoning" else OutputText(text=text)

    def start_text(self, kind: str) -> list[str]:
        """Open a reasoning or message item (closing another one first)."""
        if self.open == kind:
            return []
        out = self.close()
        item = self._item(kind)
        self.items.append(item)
        self.open, self.text = kind, ""
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        out.append(self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                              part=self._part("")))
        return out

    def delta(self, kind: str, text: str) -> list[str]:
        """A text (``kind`` "message") or thought ("reasoning") delta."""
        out = self.start_text(kind)
        self.text += text
        item, index = self.items[-1], len(self.items) - 1
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(name, item_id=item.id, output_index=index, content_index=0, delta=text, **extra))
        return out

    def close(self) -> list[str]:
        """Close the open text item: its done events, the item completed."""
        if self.open is None:
            return []
        index = len(self.items) - 1
        old = self.items[index]
        done = old.model_copy(update={"content": [self._part(self.text)], "status": "completed"})
        self.items[index] = done
        name = "response.output_text.done" if self.open == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if self.open == "message" else {}
        out = [self.event(name, item_id=done.id, output_index=index, content_index=0, text=self.text, **extra),
               self.event("response.content_part.done", item_id=done.id, output_index=index, content_index=0,
                          part=self._part(self.text)),
               self.event("response.output_item.done", output_index=index, item=done)]
        self.open, self.text = None, ""
        return out

    def calls(self, calls: list[dict[str, Any]]) -> list[str]:
        """The calls of the output (each arrives whole): added, its arguments, done."""
        out = self.close()
        for call in calls:
            fn = call["function"]
            item = FunctionCallOut(id=f"fc_{_hex()}", call_id=call["id"], name=fn["name"], arguments="",
                                   status="in_progress")
            self.items.append(item)
            index = len(self.items) - 1
            done = item.model_copy(update={"arguments": fn["arguments"], "status": "completed"})
            out += [self.event("response.output_item.added", output_index=index, item=item),
                    self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                               delta=fn["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                               name=fn["name"], arguments=fn["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=done)]
            self.items[index] = done
        return out



# --- the routes -------------------------------------------------------------------------------
def _parse(state: ServerState, store: ResponseStore, raw: bytes) -> tuple[ResponsesRequest, dict[str, Any]]:
    """The request body ``raw`` validated, and its conversation: ``history``, the chat messages of
    ``previous_response_id``'s conversation, and ``input``, those of ``body.input``.

    Raises:
        HTTPProblem: an invalid body, another model's name, or (404) a ``previous_response_id`` not in
            ``store``.
    """
    body = validate_body(ResponsesRequest, _json(raw))
    check_model(body.model, state.model_name)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise HTTPProblem(404, f"no stored response has the id {body.previous_response_id!r} (never stored, "
                              f"stored with store false, or dropped: the server keeps the last {store.capacity})",
                              "previous_response_id")
        history = prev.history
    return body, {"history": history, "input": input_messages(body)}


def _keep(store: ResponseStore, body: ResponsesRequest, response: ResponseObject,
          conv: dict[str, Any]) -> dict[str, Any]:
    """``response`` as JSON, put in ``store`` with its conversation (``conv`` and its output) unless
    ``body.store`` is false."""
    out = response.model_dump()
    if body.store is not False:
        store.put(response.id, Stored(out, conv["history"] + conv["input"] + [history_message(response.output)]))
    return out


async def _create(state: ServerState, store: ResponseStore, auto_tools: bool, request: Request) -> Response:
    """``POST /v1/responses``: the response object, its event stream (``stream``), or the problem
    (the chat path's in the Responses API's names); 499 when the client went away."""
    try:
        body, conv = _parse(state, store, await request.body())
        try:
            call = await start_chat(state, chat_body(body, conv["history"] + conv["input"], auto_tools), request)
        except HTTPProblem as e:
            raise _problem(e) from None
    except HTTPProblem as e:
        return problem_response(e)
    rid, created = f"resp_{call.prepared.request_id.split('-', 1)[1]}", int(time.time())
    if body.stream:
        return StreamingResponse(_stream(state, store, body, call, rid, created, conv),
                                 media_type="text/event-stream")
    try:
        chat = await call.result(request)
    except HTTPProblem as e:
        return problem_response(_problem(e))
    if chat is None:
        return Response(status_code=499)
    choice = chat["choices"][0]
    items = output_items(choice["message"])
    usage = usage_of(chat["usage"], _reasoning_tokens(state.tokenizer, items))
    response = response_object(body, rid, created, state.model_name, status_of(choice["finish_reason"]), items,
                               usage)
    return JSONResponse(_keep(store, body, response, conv))


async def _stream(state: ServerState, store: ResponseStore, body: ResponsesRequest, call: ChatCall, rid: str,
                  created: int, conv: dict[str, Any]) -> AsyncIterator[str]:
    """The events of a streamed response (see the module) from ``call``'s chat chunks; the completed
    response is kept (:func:`_keep`), a failed one is not."""
    w = EventWriter()
    start = response_object(body, rid, created, state.model_name, "in_progress", [])
    yield w.event("response.created", response=start)
    yield w.event("response.in_progress", response=start)
    def failed(err: dict[str, Any]) -> list[str]:
        final = response_object(body, rid, created, state.model_name, "failed", w.items,
                                error=ResponseError(code="server_error", message=err.get("message", "")))
        return [w.event("error", code=str(err.get("type")), message=err.get("message"), param=err.get("param")),
                w.event("response.failed", response=final)]

    async for event in w.events(call, failed):
        yield event
    if w.failed:
        return
    usage = usage_of(w.usage, _reasoning_tokens(state.tokenizer, w.items))
    final = response_object(body, rid, created, state.model_name, status_of(w.finish), w.items, usage)
    _keep(store, body, final, conv)
    yield w.event("response.completed", response=final)


def _get(store: ResponseStore, response_id: str) -> Response:
    """``GET /v1/responses/{response_id}``: the stored response, or a 404 problem."""
    item = store.get(response_id)
    if item is None:
        return problem_response(HTTPProblem(404, f"no stored response has the id {response_id!r}", "response_id"))
    return JSONResponse(item.response)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """``POST /v1/responses`` and ``GET /v1/responses/{response_id}`` over a store of its own
    (``app.state.responses_store``)."""
    store = ResponseStore()
    auto_tools = state.enable_auto_tool_choice and state.tool_parser is not None

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await _create(state, store, auto_tools, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return _get(store, response_id)

    app.state.responses_store = store
