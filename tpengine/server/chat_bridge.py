"""The chat-completions path as other APIs use it: ``/v1/responses`` and ``/v1/messages`` translate
their body into a ``/v1/chat/completions`` body, which goes through the chat route's own machinery
(:func:`tpengine.server.serving.prepare_request`: validation, chat template, tools, structured
outputs, reasoning parser, length checks; the engine loop; :func:`~tpengine.server.serving.response_body`
and :func:`~tpengine.server.serving.stream_events` for the result), and translate the chat result
(a ``chat.completion`` body, or its ``chat.completion.chunk`` dicts) back into their own shapes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tpengine.engine.outputs import EngineOutput
from tpengine.server.app import ServerState, _disconnected, _outputs, submit
from tpengine.server.middleware import request_id
from tpengine.server.serving import HTTPProblem, Prepared, output_problem, prepare_request, response_body, stream_events


def prepare_chat(state: ServerState, obj: dict[str, Any], base_id: str | None = None) -> Prepared:
    """A chat completions body prepared as the chat route prepares it, its output constraint compiled
    (a schema the grammar library refuses is a 400); ``base_id``: the request's id (its ``x-request-id``).

    Raises:
        HTTPProblem: as :func:`tpengine.server.serving.prepare_request`; 400 for a refused constraint.
    """
    p = prepare_request(obj, "chat", state.tokenizer, state.vocab_size, state.max_model_len, state.model_name,
                        state.defaults, state.tool_parser, state.enable_auto_tool_choice, state.reasoning_parser,
                        base_id)
    if p.params.structured_outputs is not None and state.check_grammar is not None:
        try:
            state.check_grammar(p.params.structured_outputs)
        except ValueError as e:
            raise HTTPProblem(400, str(e), p.structured_field) from None
    return p


@dataclass
class ChatCall:
    """One chat request running on the engine: its :class:`Prepared` form and the queue its outputs
    arrive on; ``final`` is its last engine output once it finished (token ids, text, usage)."""

    state: ServerState
    prepared: Prepared
    queue: asyncio.Queue
    final: EngineOutput | None = field(default=None)

    def abort(self) -> None:
        """Free the request's KV blocks (a no-op once it finished)."""
        for rid in self.prepared.engine_ids():
            self.state.loop.abort(rid)

    async def result(self, request: Request) -> dict[str, Any] | None:
        """The ``chat.completion`` body once the request finished; None when the client went away
        first (the request is then aborted).

        Raises:
            HTTPProblem: the engine stopped (503) or the request failed (its error).
        """
        ids = self.prepared.engine_ids()

        async def finals() -> list[EngineOutput]:
            got = {out.request_id: out async for out in _outputs(self.queue, ids) if out.finished}
            return [got[rid] for rid in ids]

        result = asyncio.ensure_future(finals())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            result.cancel()
            self.abort()
            return None
        gone.cancel()
        outs = result.result()
        if failed := next((o for o in outs if o.error is not None), None):
            raise output_problem(failed)
        self.final = outs[0]
        return response_body(self.prepared, outs, self.state.model_name)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` dicts of the streamed request (the role chunk, the content and
        reasoning deltas, the tool calls whole with the finish reason, the usage chunk), as the chat
        route streams them; a failure is one ``{"error": {...}}`` dict, last. Closing the iterator
        early (the client went away) aborts the request."""
        finished = False

        async def tap() -> AsyncIterator[EngineOutput]:
            async for out in _outputs(self.queue, self.prepared.engine_ids()):
                if out.finished:
                    self.final = out
                yield out

        try:
            try:
                async for event in stream_events(self.prepared, tap(), self.state.model_name):
                    data = event.removeprefix("data: ").strip()
                    if data != "[DONE]":
                        yield json.loads(data)
            except HTTPProblem as e:
                yield e.body()
            finished = True
        finally:
            if not finished:
                self.abort()


async def start_chat(state: ServerState, obj: dict[str, Any], request: Request) -> ChatCall:
    """Prepare the chat body ``obj`` of ``request`` (off the event loop: templating a long conversation
    takes a while; its id is the request's ``x-request-id``, as the chat route's) and submit it.

    Raises:
        HTTPProblem: 503 when the engine is not running; a bad body's 400 / 404 (:func:`prepare_chat`);
            400 for the id of a request still running.
    """
    if state.loop.dead is not None:
        raise HTTPProblem(503, f"the engine is not running: {state.loop.dead}")
    p = await asyncio.to_thread(prepare_chat, state, obj, request_id(request))
    queue: asyncio.Queue = asyncio.Queue()
    submit(state, p.engine_ids(), p.prompt_ids, p.params, p.stream, queue)
    return ChatCall(state, p, queue)


def renamed(e: HTTPProblem, names: Callable[[str], str]) -> HTTPProblem:
    """``e`` with its ``param`` (a chat body's field path) given the other API's name (``names``), in
    the message too where it starts with it."""
    if e.param is None:
        return HTTPProblem(e.status, e.message, None)
    param = names(e.param)
    message = e.message
    if message.startswith(f"{e.param}: "):
        message = f"{param}: {message[len(e.param) + 2:]}"
    return HTTPProblem(e.status, message, param)


def matched_stop(tokenizer: Any, out: EngineOutput, stops: tuple[str, ...] | None) -> str | None:
    """The stop string that ended ``out`` (sample 0), if one did: the engine cuts the text before
    it, so it is where the decoded token ids go on past the text. None when EOS, a stop token or
    the length ended it."""
    if not stops or out.finish_reason != "stop" or not out.outputs:
        return None
    o = out.outputs[0]
    full = tokenizer.decode(o.token_ids, skip_special_tokens=True)
    if not full.startswith(o.text):
        return None
    rest = full[len(o.text):]
    return next((s for s in stops if rest.startswith(s)), None)


class ChatEventWriter:
    """The common part of the Responses and Messages stream writers: each streamed chat chunk's deltas
    in order -- the thought, the text, the tool calls -- handed to the subclass's ``delta(kind, text)``
    and ``calls(tool_calls)``, which return that API's server-sent events; the chat usage and finish
    reason kept. ``THOUGHT`` / ``TEXT``: the subclass's names of the two kinds of streamed text."""

    THOUGHT = "thinking"
    TEXT = "text"

    def __init__(self) -> None:
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def delta(self, kind: str, text: str) -> list[str]:
        raise NotImplementedError

    def calls(self, calls: list[dict[str, Any]]) -> list[str]:
        raise NotImplementedError

    failed = False  #: set by :meth:`events` when the chat stream ended with an error chunk

    async def events(self, call: ChatCall, on_error: Callable[[dict[str, Any]], list[str]]) -> AsyncIterator[str]:
        """The events of ``call``'s chat stream, then those closing the open block or item; an error chunk
        ends it with ``on_error(error)``'s events and sets :attr:`failed` (nothing is closed then)."""
        chunks = call.chunks()
        try:
            async for chunk in chunks:
                if "error" in chunk:
                    self.failed = True
                    for event in on_error(chunk["error"]):
                        yield event
                    return
                for event in self.chunk(chunk):
                    yield event
        finally:
            await chunks.aclose()
        for event in self.close():
            yield event

    def close(self) -> list[str]:
        raise NotImplementedError

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (a chat completions stream chunk as a dict)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.delta(self.THOUGHT, delta["reasoning_content"])
            if delta.get("content"):
                out += self.delta(self.TEXT, delta["content"])
            if delta.get("tool_calls"):
                out += self.calls(delta["tool_calls"])
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out


def chat_param_as(param: str, names: Mapping[str, str], tools: Callable[[str], str]) -> str:
    """A chat body's field path (an error's ``param``) as another API names it: a top-level field of
    ``names`` by its name there (an index into it dropped), a ``tools`` path through ``tools``, a named
    ``tool_choice``'s ``function.`` level dropped, anything else as it is."""
    base = param.partition(".")[0].split("[")[0]
    if base in names:
        return names[base]
    if base == "tools":
        return tools(param)
    if base == "tool_choice":
        return param.replace("tool_choice.function.", "tool_choice.", 1)
    return param

