"""The OpenAI-compatible HTTP app on rank 0 (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(``stream`` true and false), ``/v1/models``, ``/health``, ``/metrics``.

Every request is answered on its own: a bad body is a 400 naming the field, an engine that is no
longer running a 503, and a request's own failure its own error (HTTP error, or an error event in
its stream). A client that disconnects aborts its request, whose KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tpengine.engine.outputs import EngineOutput
from tpengine.server.engine_loop import EngineDead, EngineLoop
from tpengine.server.metrics import ServerMetrics
from tpengine.server.serving import (
    HTTPProblem,
    Prepared,
    output_problem,
    prepare_request,
    response_body,
    stream_events,
)


@dataclass
class ServerState:
    """What the routes share: the engine loop and what requests are checked against."""

    loop: EngineLoop
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    model_name: str
    metrics: ServerMetrics
    defaults: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams defaults ([sampling] table)
    created: int = 0


def problem_response(p: HTTPProblem) -> JSONResponse:
    return JSONResponse(p.body(), status_code=p.status)


async def _outputs(queue: asyncio.Queue) -> AsyncIterator[EngineOutput]:
    """A request's engine outputs until its final one; an :class:`EngineDead` is raised as an HTTP 503.
    Outputs so far are cumulative, so when several are queued (the client reads slower than the
    engine steps) only the latest is yielded."""
    while True:
        item = await queue.get()
        while not queue.empty() and not (isinstance(item, EngineOutput) and item.finished):
            item = queue.get_nowait()
        if isinstance(item, BaseException):
            raise HTTPProblem(503, str(item))
        yield item
        if item.finished:
            return


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _parse_and_prepare(body: bytes, kind: str, state: ServerState) -> Prepared:
    """The request body, decoded and prepared. Raises HTTPProblem (400: not JSON, or see
    :func:`tpengine.server.serving.prepare_request`)."""
    try:
        obj = json.loads(body)
    except ValueError as e:  # not JSON, invalid UTF-8, an integer of more than 4300 digits
        raise HTTPProblem(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPProblem(400, "the request body is not valid JSON: nested too deeply") from None
    return prepare_request(obj, kind, state.tokenizer, state.vocab_size, state.max_model_len, state.model_name,
                           state.defaults)


def build_app(state: ServerState) -> FastAPI:
    """The app serving ``state``."""
    app = FastAPI(title="tpengine", docs_url=None, redoc_url=None)

    async def handle(request: Request, kind: str) -> Response:
        if state.loop.dead is not None:
            return problem_response(HTTPProblem(503, f"the engine is not running: {state.loop.dead}"))
        try:
            body = await request.body()
            # parsing and tokenizing (a long prompt takes a while) run off the event loop, so other
            # clients' streams and /health go on meanwhile
            p = await asyncio.to_thread(_parse_and_prepare, body, kind, state)
            try:
                queue = state.loop.submit(p.request_id, p.prompt_token_ids, p.params, p.stream)
            except EngineDead as e:
                raise HTTPProblem(503, str(e)) from None
        except HTTPProblem as e:
            return problem_response(e)
        if p.stream:
            return StreamingResponse(_stream(p, queue), media_type="text/event-stream")
        return await _complete(request, p, queue)

    async def _stream(p: Prepared, queue: asyncio.Queue) -> AsyncIterator[str]:
        finished = False
        try:
            async for event in stream_events(p, _outputs(queue), state.model_name):
                yield event
            finished = True
        except HTTPProblem as e:
            yield f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away (the response task was cancelled)
                state.loop.abort(p.request_id)

    async def _complete(request: Request, p: Prepared, queue: asyncio.Queue) -> Response:
        async def final() -> EngineOutput:
            async for out in _outputs(queue):
                if out.finished:
                    return out
            raise AssertionError("unreachable")

        result = asyncio.ensure_future(final())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():  # the client went away: free its blocks now
            result.cancel()
            state.loop.abort(p.request_id)
            return Response(status_code=499)
        gone.cancel()
        try:
            out = result.result()
        except HTTPProblem as e:
            return problem_response(e)
        if out.error is not None:
            return problem_response(output_problem(out))
        return JSONResponse(response_body(p, out, state.model_name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "tpengine", "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if state.loop.dead is not None:
            return problem_response(HTTPProblem(503, f"the engine is not running: {state.loop.dead}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
