"""The app's route table and its engine-free routes, without a server or an engine: build_app's
route groups keep vLLM's paths and methods. The routes over a live engine: tests/test_server.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from fastapi.routing import APIRoute

from tpengine import __version__
from tpengine.server.app import ServerState, build_app


def app(dead: str | None = None):
    state = ServerState(loop=SimpleNamespace(dead=dead), tokenizer=None, vocab_size=8, max_model_len=64,
                        model_name="tiny", metrics=SimpleNamespace(render=lambda: b"# metrics\n"), created=7)
    return {r.path: r for r in build_app(state).routes if isinstance(r, APIRoute)}


def call(route: APIRoute, **kw):
    return asyncio.run(route.endpoint(**kw))


def test_the_routes_are_vllms():
    assert [(path, sorted(r.methods)) for path, r in app().items()] == [
        ("/v1/completions", ["POST"]), ("/v1/chat/completions", ["POST"]), ("/v1/models", ["GET"]),
        ("/v1/models/{model_id:path}", ["GET"]), ("/version", ["GET"]), ("/tokenizer_info", ["GET"]),
        ("/tokenize", ["POST"]), ("/detokenize", ["POST"]), ("/health", ["GET"]), ("/metrics", ["GET"]),
        ("/v1/responses", ["POST"]), ("/v1/responses/{response_id}", ["GET"]), ("/v1/messages", ["POST"]),
        ("/v1/messages/count_tokens", ["POST"]), ("/v1/embeddings", ["POST"])]


def test_a_pooling_server_has_embeddings_and_refuses_generation():
    state = ServerState(loop=SimpleNamespace(dead=None), tokenizer=None, vocab_size=8, max_model_len=64,
                        model_name="tiny", metrics=None, runner="pooling")
    routes = [(r.path, sorted(r.methods)) for r in build_app(state).routes if isinstance(r, APIRoute)]
    assert routes == [("/v1/models", ["GET"]), ("/v1/models/{model_id:path}", ["GET"]), ("/version", ["GET"]),
                      ("/tokenizer_info", ["GET"]), ("/tokenize", ["POST"]), ("/detokenize", ["POST"]),
                      ("/health", ["GET"]), ("/metrics", ["GET"]), ("/v1/embeddings", ["POST"]),
                      ("/v1/completions", ["POST"]), ("/v1/chat/completions", ["POST"]), ("/v1/responses", ["POST"]),
                      ("/v1/messages", ["POST"])]
    refusal = json.loads(call(next(r for r in build_app(state).routes if r.path == "/v1/chat/completions")).body)
    assert refusal["error"]["message"].startswith("The model does not support the Chat Completions API")


def test_health_is_503_once_the_engine_is_not_running():
    assert call(app()["/health"]).status_code == 200
    down = call(app("rank 1 exited")["/health"])
    assert down.status_code == 503
    assert json.loads(down.body)["error"]["message"] == "the engine is not running: rank 1 exited"


def test_models_version_and_metrics():
    routes = app()
    card = {"id": "tiny", "object": "model", "created": 7, "owned_by": "tpengine", "root": "tiny", "parent": None,
            "max_model_len": 64}
    assert call(routes["/v1/models"]) == {"object": "list", "data": [card]}
    assert json.loads(call(routes["/v1/models/{model_id:path}"], model_id="tiny").body) == card
    assert call(routes["/v1/models/{model_id:path}"], model_id="other").status_code == 404
    assert call(routes["/version"]) == {"version": __version__}
    assert call(routes["/metrics"]).body == b"# metrics\n"
