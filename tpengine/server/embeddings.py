"""``POST /v1/embeddings`` (OpenAI's embeddings API, as vLLM's pooling server serves it) and a pooling
server's answer to the generation routes.

A server started with ``--runner pooling`` (:mod:`tpengine.engine.pooling`) serves embeddings: each
input of the body is one engine request (``embd-<id>``, ``-<i>`` after it when there are several),
prefilled and pooled, and the response holds one ``data[i]`` per input, in order, as floats or
base64 (:mod:`tpengine.protocol.embeddings`). It generates no text: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` answer a 400 naming the API, as vLLM's
do for a model without the task; and a generating server's ``/v1/embeddings`` answers a 400 naming
``--runner pooling``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tpengine.engine.outputs import EngineOutput
from tpengine.pooling_params import PoolingParams
from tpengine.protocol.embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from tpengine.server.app import ServerState, _engine_dead, _json, finished_outputs, problem_response, submit
from tpengine.server.middleware import request_id
from tpengine.server.serving import HTTPProblem, check_model, validate_body

#: The generation routes a pooling server refuses, with the API each serves (vLLM's message names it).
GENERATION_ROUTES = {"/v1/completions": "Completions", "/v1/chat/completions": "Chat Completions",
                     "/v1/responses": "Responses", "/v1/messages": "Messages"}


@dataclass
class EmbeddingCall:
    """An embeddings body ready for the engine: the response's id, the encoding, the pooling options
    and each input's token ids (one engine request each)."""

    request_id: str
    base64: bool
    params: PoolingParams
    prompt_ids: list[list[int]]
    created: int

    def engine_ids(self) -> list[str]:
        """The engine request id of each input: the response's id, with ``-<i>`` when there are several."""
        if len(self.prompt_ids) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompt_ids))]


def prepare_embedding(obj: Any, state: ServerState, base_id: str) -> EmbeddingCall:
    """Validate an embeddings body (lenient, :func:`tpengine.server.serving.validate_body`) and tokenize
    its inputs: a string as a completions prompt (the tokenizer's special tokens unless
    ``add_special_tokens`` is false), a token-id list as it is. ``base_id``: the request's id (its
    ``x-request-id``), the response's ``embd-<id>``.

    Raises:
        HTTPProblem: 400 for an invalid body (naming the field), an input without tokens, a token id
            outside the vocabulary or an input longer than ``max_model_len`` (vLLM's message); 404
            for another ``model``.
    """
    body = validate_body(EmbeddingRequest, obj)
    check_model(body.model, state.model_name)
    try:
        inputs = body.inputs()
    except ValueError as e:
        raise HTTPProblem(400, f"input: {e}", "input") from None
    add = body.add_special_tokens is not False
    prompt_ids = []
    for i, (kind, payload) in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if kind == "prompt":
            try:
                ids = list(state.tokenizer(payload, add_special_tokens=add)["input_ids"])
            except Exception as e:  # noqa: BLE001 -- e.g. a lone surrogate: this request's
                raise HTTPProblem(400, f"{where}: tokenizing failed: {type(e).__name__}: {e}", "input") from None
        else:
            ids = payload
        if not ids:
            raise HTTPProblem(400, f"{where}: the input has no tokens", "input")
        if (bad := next((t for t in ids if t >= state.vocab_size), None)) is not None:
            raise HTTPProblem(400, f"{where}: token id {bad} is out of range: vocab size is {state.vocab_size}",
                              "input")
        if len(ids) > state.max_model_len:
            raise HTTPProblem(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                              f"you requested {len(ids)} tokens in the input for embedding generation ({where}). "
                              "Please reduce the length of the input.", "input")
        prompt_ids.append(ids)
    params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    return EmbeddingCall(f"embd-{base_id}", body.encoding_format == "base64", params, prompt_ids, int(time.time()))


def encode(vec: Any, as_base64: bool) -> list[float] | str:
    """One embedding (a float32 tensor) as the response carries it: a list of floats, or (``as_base64``)
    its float32 values' little-endian bytes in base64, as vLLM and OpenAI encode them."""
    if as_base64:
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def embedding_body(call: EmbeddingCall, outs: list[EngineOutput], model_name: str) -> dict[str, Any]:
    """The response body of ``call`` from its inputs' finished outputs (in order)."""
    data = [EmbeddingData(index=i, embedding=encode(o.embedding, call.base64)) for i, o in enumerate(outs)]
    tokens = sum(len(ids) for ids in call.prompt_ids)
    return EmbeddingResponse(id=call.request_id, created=call.created, model=model_name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump()


async def _embed(state: ServerState, request: Request) -> Response:
    """One embeddings request: its inputs go to the engine; the answer comes once all finished, 499
    (their blocks freed) when the client goes away first."""
    if state.runner != "pooling":
        return problem_response(HTTPProblem(
            400, "The model does not support the Embeddings API: this server generates text; start it with "
            "--runner pooling (vLLM's flag) to serve /v1/embeddings"))
    if (dead := _engine_dead(state)) is not None:
        return dead
    try:
        obj = _json(await request.body())
        call = await asyncio.to_thread(prepare_embedding, obj, state, request_id(request))
        ids = call.engine_ids()
        queue: asyncio.Queue = asyncio.Queue()
        submit(state, ids, call.prompt_ids, call.params, False, queue)
    except HTTPProblem as e:
        return problem_response(e)
    outs = await finished_outputs(state, request, queue, ids)
    if isinstance(outs, Response):
        return outs
    if any(o.embedding is None for o in outs):  # aborted (the server is shutting down)
        return problem_response(HTTPProblem(503, "the request was aborted before its embeddings were made"))
    return JSONResponse(embedding_body(call, outs, state.model_name))


def add_embeddings_routes(app: FastAPI, state: ServerState) -> None:
    """``POST /v1/embeddings``; on a pooling server (``state.runner`` "pooling") also the generation
    routes of :data:`GENERATION_ROUTES`, each a 400 naming its API."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _embed(state, request)

    if state.runner != "pooling":
        return
    for path, api in GENERATION_ROUTES.items():
        app.add_api_route(path, _refusal(api), methods=["POST"])


def _refusal(api: str):
    """A route answering that a pooling server does not serve ``api``."""
    async def refuse() -> Response:
        return problem_response(HTTPProblem(
            400, f"The model does not support the {api} API: this server runs --runner pooling and makes "
            "embeddings (POST /v1/embeddings); start it without --runner pooling to generate text"))

    return refuse
