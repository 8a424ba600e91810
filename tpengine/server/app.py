"""The OpenAI-compatible HTTP app on rank 0 (FastAPI): ``/v1/completions`` (one or more prompts,
``echo``), ``/v1/chat/completions`` (``stream`` true and false), ``/v1/models`` and
``/v1/models/{id}``, vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and ``/version``, ``/health``,
``/metrics``; ``/v1/embeddings`` on a pooling server (``--runner pooling``), whose generation routes answer
a 400 (:mod:`tpengine.server.embeddings`). Unknown body fields are ignored and logged once each, as vLLM does.

Every request is answered on its own: a bad body is a 400 naming the field, an engine that is no
longer running a 503, and a request's own failure its own error (HTTP error, or an error event in
its stream). A client that disconnects aborts its request, whose KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tpengine import __version__
from tpengine.engine.outputs import EngineOutput
from tpengine.server.engine_loop import EngineDead, EngineLoop
from tpengine.server.metrics import ServerMetrics
from tpengine.server.middleware import install, request_id
from tpengine.server.serving import (
    HTTPProblem,
    Prepared,
    check_model,
    detokenize_body,
    output_problem,
    prepare_request,
    response_body,
    stream_events,
    tokenize_body,
    tokenizer_info_body,
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
    # compiles a request's output constraint (the engine's grammar cache); raises ValueError when it cannot
    check_grammar: Callable[[Any], None] | None = None
    tool_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # the engine's --reasoning-parser
    runner: str = "generate"  # the engine's --runner: "pooling" serves /v1/embeddings and no generation route


def problem_response(p: HTTPProblem) -> JSONResponse:
    """``p`` as its JSON error body with its HTTP status."""
    return JSONResponse(p.body(), status_code=p.status)


async def _outputs(queue: asyncio.Queue, request_ids: list[str]) -> AsyncIterator[EngineOutput]:
    """The engine outputs of ``request_ids`` (one HTTP request's prompts, sharing ``queue``) until
    each one's final output; an :class:`EngineDead` is raised as an HTTP 503. Outputs so far are
    cumulative, so when several of one request are queued (the client reads slower than the engine
    steps) only its latest is yielded."""
    pending = set(request_ids)
    while pending:
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        latest: dict[str, EngineOutput] = {}
        for item in items:
            if isinstance(item, BaseException):
                raise HTTPProblem(503, str(item))
            if not (item.request_id in latest and latest[item.request_id].finished):
                latest[item.request_id] = item
        for rid, out in latest.items():
            if rid in pending:
                yield out
                if out.finished:
                    pending.discard(rid)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def submit(state: ServerState, ids: list[str], prompts: Sequence[list[int]], params: Any, stream: bool,
           queue: asyncio.Queue) -> None:
    """Hand each prompt to the engine under its engine id (outputs into ``queue``).

    Raises:
        HTTPProblem: 400 for an id of a request still running (a reused ``x-request-id``); 503 when the
            engine stopped meanwhile (whatever was submitted is aborted).
    """
    if busy := next((rid for rid in ids if state.loop.running(rid)), None):
        raise HTTPProblem(400, f"the request id {busy!r} (from the x-request-id header) is the id of a request "
                          "still running; send a unique x-request-id")
    try:
        for rid, prompt in zip(ids, prompts):
            state.loop.submit(rid, prompt, params, stream, into=queue)
    except EngineDead as e:
        for rid in ids:
            state.loop.abort(rid)
        raise HTTPProblem(503, str(e)) from None


async def finished_outputs(state: ServerState, request: Request, queue: asyncio.Queue,
                           ids: list[str]) -> list[EngineOutput] | Response:
    """Every id's final output, in ``ids``' order; a 499 response (the requests aborted, their blocks
    freed) if the client goes away first, or an error response (an output error's status) for a
    failed one."""
    async def finals() -> dict[str, EngineOutput]:
        return {out.request_id: out async for out in _outputs(queue, ids) if out.finished}

    result = asyncio.ensure_future(finals())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not result.done():  # the client went away: free its blocks now
        result.cancel()
        for rid in ids:
            state.loop.abort(rid)
        return Response(status_code=499)
    gone.cancel()
    try:
        outs = [result.result()[rid] for rid in ids]
    except HTTPProblem as e:
        return problem_response(e)
    if failed := next((o for o in outs if o.error is not None), None):
        return problem_response(output_problem(failed))
    return outs


def _json(body: bytes) -> Any:
    """The request body as JSON. Raises HTTPProblem (400: not JSON)."""
    try:
        return json.loads(body)
    except ValueError as e:  # not JSON, invalid UTF-8, an integer of more than 4300 digits
        raise HTTPProblem(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPProblem(400, "the request body is not valid JSON: nested too deeply") from None


def _parse_and_prepare(body: bytes, kind: str, state: ServerState, base_id: str | None = None) -> Prepared:
    """The request body, decoded and prepared; ``base_id``: the request's id (its ``x-request-id``).
    Raises HTTPProblem (400: not JSON, or see :func:`tpengine.server.serving.prepare_request`)."""
    p = prepare_request(_json(body), kind, state.tokenizer, state.vocab_size, state.max_model_len,
                        state.model_name, state.defaults, state.tool_parser, state.enable_auto_tool_choice,
                        state.reasoning_parser, base_id)
    if p.params.structured_outputs is not None and state.check_grammar is not None:
        try:  # a schema the grammar library refuses is this request's 400; compiled, it is cached for the engine
            state.check_grammar(p.params.structured_outputs)
        except ValueError as e:
            raise HTTPProblem(400, str(e), p.structured_field) from None
    return p


def build_app(state: ServerState, api_keys: Sequence[str] = ()) -> FastAPI:
    """The app serving ``state``: the generation routes (on a pooling server, ``state.runner``
    "pooling", ``/v1/embeddings`` instead), the model list, the tokenizer routes and
    the health and metrics routes; every error as OpenAI's error object, an ``x-request-id`` on every
    response, and with ``api_keys`` every route under ``/v1`` behind them
    (:func:`tpengine.server.middleware.install`)."""
    app = FastAPI(title="tpengine", docs_url=None, redoc_url=None)
    install(app, api_keys)
    # /v1/responses, /v1/messages (other APIs over the chat path) and /v1/embeddings: imported here, they
    # import this module
    from tpengine.server.anthropic_messages import add_messages_routes
    from tpengine.server.embeddings import add_embeddings_routes
    from tpengine.server.responses import add_responses_routes

    if state.runner != "pooling":
        _add_generation_routes(app, state)
    _add_model_routes(app, state)
    _add_tokenizer_routes(app, state)
    _add_health_routes(app, state)
    if state.runner != "pooling":
        add_responses_routes(app, state)
        add_messages_routes(app, state)
    add_embeddings_routes(app, state)  # on a pooling server also the generation routes' refusals
    return app


def _engine_dead(state: ServerState) -> Response | None:
    """The 503 of an engine that is no longer running, else None."""
    if state.loop.dead is not None:
        return problem_response(HTTPProblem(503, f"the engine is not running: {state.loop.dead}"))
    return None


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    """A completion (``kind`` "completion") or chat completion ("chat") request: its prompts go to
    the engine, the answer streams (``stream``) or comes once every prompt finished."""
    if (dead := _engine_dead(state)) is not None:
        return dead
    try:
        body = await request.body()
        # parsing and tokenizing (a long prompt takes a while) run off the event loop, so other
        # clients' streams and /health go on meanwhile
        p = await asyncio.to_thread(_parse_and_prepare, body, kind, state, request_id(request))
        queue: asyncio.Queue = asyncio.Queue()
        submit(state, p.engine_ids(), p.prompt_ids, p.params, p.stream, queue)
    except HTTPProblem as e:
        return problem_response(e)
    if p.stream:
        return StreamingResponse(_stream(state, p, queue), media_type="text/event-stream")
    return await _complete(state, request, p, queue)


async def _stream(state: ServerState, p: Prepared, queue: asyncio.Queue) -> AsyncIterator[str]:
    """The server-sent events of a streaming request; a failure is an error event, then ``[DONE]``."""
    finished = False
    try:
        async for event in stream_events(p, _outputs(queue, p.engine_ids()), state.model_name):
            yield event
        finished = True
    except HTTPProblem as e:
        yield f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n"
        finished = True
    finally:  # the client went away (the response task was cancelled), or one prompt failed while
        # its siblings run on: free every prompt's blocks (aborting a finished request is a no-op)
        if not finished or len(p.prompt_ids) > 1:
            for rid in p.engine_ids():
                state.loop.abort(rid)


async def _complete(state: ServerState, request: Request, p: Prepared, queue: asyncio.Queue) -> Response:
    """The one response of a non-streaming request, once every prompt finished; 499 (and its
    blocks freed) when the client goes away first, a request's own failure as its HTTP error."""
    outs = await finished_outputs(state, request, queue, p.engine_ids())
    return outs if isinstance(outs, Response) else JSONResponse(response_body(p, outs, state.model_name))


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/models``, ``/v1/models/{id}`` and ``/version``."""

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tpengine",
                "root": state.model_name, "parent": None, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            check_model(model_id, state.model_name)
        except HTTPProblem as e:
            return problem_response(e)
        return JSONResponse(model_card())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's ``/tokenizer_info``, ``/tokenize`` and ``/detokenize``."""

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenizer_info_body(state.tokenizer, state.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            obj = _json(await request.body())
            out = await asyncio.to_thread(tokenize_body, obj, state.tokenizer, state.vocab_size, state.max_model_len,
                                          state.model_name)
        except HTTPProblem as e:
            return problem_response(e)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            obj = _json(await request.body())
            out = await asyncio.to_thread(detokenize_body, obj, state.tokenizer, state.vocab_size, state.model_name)
        except HTTPProblem as e:
            return problem_response(e)
        return JSONResponse(out)


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    """``/health`` (503 once the engine is not running) and ``/metrics`` (Prometheus)."""

    @app.get("/health")
    async def health() -> Response:
        dead = _engine_dead(state)
        return dead if dead is not None else Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
