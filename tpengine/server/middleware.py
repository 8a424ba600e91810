"""What every route of the server shares, as vLLM's server does it: the request id (``x-request-id``),
the API key check (``--api-key``), ``HEAD`` on the ``GET`` routes, and OpenAI's error object for every
error, the framework's own (unknown route 404, wrong method 405, a malformed path parameter) included.

Both middlewares are plain ASGI (no body buffering, so streams pass through untouched); the request id
is the outer one, so a 401 carries its ``x-request-id`` too.
"""

from __future__ import annotations

import hashlib
import secrets
import sys
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpengine.server.serving import HTTPProblem

#: The request header (and response header) of a request's id, vLLM's name.
REQUEST_ID_HEADER = "x-request-id"
#: The environment variable ``--api-key`` falls back to (vLLM's is ``VLLM_API_KEY``).
API_KEY_ENV = "TPENGINE_API_KEY"
#: The paths the API key protects: ``/v1`` and everything under it, as vLLM (``/health``, ``/metrics``,
#: ``/version`` and vLLM's tokenizer routes stay open).
PROTECTED_PREFIX = "/v1"


def request_id(request: Request) -> str:
    """The id of ``request``: its ``x-request-id`` header, else the one :class:`RequestIdMiddleware`
    generated (32 hex digits); a new one for a request that did not pass the middleware."""
    rid = getattr(request.state, "request_id", None)
    return rid if rid is not None else uuid.uuid4().hex


class RequestIdMiddleware:
    """Gives every HTTP request an id: the client's ``x-request-id`` header when it sends one, else a
    new uuid4 (hex); the id is ``request.state.request_id`` for the routes (the base of the engine
    request's id, so logs name it) and comes back in the response's ``x-request-id`` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeadMiddleware:
    """Answers ``HEAD`` on every ``GET`` route (e.g. ``HEAD /health``, a load balancer's probe) as
    Starlette does for its plain routes: the route runs as ``GET`` and its status and headers go out
    without the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        # a copy: the server's own scope keeps HEAD, so it sends no body either
        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


class ApiKeyMiddleware:
    """Answers 401 (OpenAI's error object, ``WWW-Authenticate: Bearer``) to a request under ``/v1``
    whose ``Authorization`` header is not ``Bearer <one of keys>`` (nor its ``x-api-key`` header one of
    them); other paths and CORS preflights (OPTIONS) pass. Only the keys' SHA-256 digests are kept,
    and a presented key is compared with every one of them in constant time
    (:func:`secrets.compare_digest`), so neither its content nor which key it nearly matches shows in
    the time the check takes.

    Raises:
        ValueError: no key, or an empty one (at construction).
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("ApiKeyMiddleware needs at least one key, none of them empty")
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def authorized(self, headers: Headers) -> bool:
        """Whether ``headers`` carry ``Authorization: Bearer <a key>`` (the scheme in any case), or
        ``x-api-key: <a key>`` (how the ``anthropic`` SDK sends its key, for ``/v1/messages``)."""
        scheme, _, given = headers.get("authorization", "").partition(" ")
        presented = [given.strip()] if scheme.lower() == "bearer" else []
        if "x-api-key" in headers:
            presented.append(headers["x-api-key"].strip())
        ok = False
        for key in presented:
            digest = hashlib.sha256(key.encode()).digest()
            for d in self._digests:  # every key is compared: no early exit
                ok |= secrets.compare_digest(digest, d)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if (path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")) and \
                    not self.authorized(Headers(scope=scope)):
                given = "authorization" in Headers(scope=scope) or "x-api-key" in Headers(scope=scope)
                message = ("Incorrect API key provided: the key sent (the Authorization header's bearer token or "
                           "the x-api-key header) is not an API key of this server" if given else
                           "Missing API key: send it as the header 'Authorization: Bearer <key>'")
                response = JSONResponse(HTTPProblem(401, message).body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def problem_json(p: HTTPProblem, headers: dict[str, str] | None = None) -> JSONResponse:
    """``p`` as OpenAI's error object with its status (and ``headers``)."""
    return JSONResponse(p.body(), status_code=p.status, headers=headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The framework's own errors (no route: 404; a route without this method: 405, with its
    ``Allow`` header) as OpenAI's error object."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Not Found: no route {where}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        message = f"Method Not Allowed: {where}" + (f" (this route takes {allowed})" if allowed else "")
    else:
        message = str(exc.detail)
    return problem_json(HTTPProblem(exc.status_code, message), exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's request validation (a route's declared parameters) as a 400 naming the first field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
    field = ".".join(loc) or None
    message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors)
    return problem_json(HTTPProblem(400, message or "invalid request", field))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """An exception no route caught: a 500 with OpenAI's error object, the line on stderr naming the
    request's id."""
    rid = getattr(request.state, "request_id", None)
    print(f"[tpengine rank 0] request {rid!r} ({request.method} {request.url.path}) failed: "
          f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return problem_json(HTTPProblem(500, f"internal server error: {type(exc).__name__}: {exc}"))


def install(app: FastAPI, api_keys: Sequence[str] = ()) -> None:
    """Add to ``app`` the error handlers (every error as OpenAI's error object), the API key check
    when ``api_keys`` holds any key, and the request id (outermost)."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(HeadMiddleware)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=list(api_keys))
    app.add_middleware(RequestIdMiddleware)  # added last: the outermost
