"""The OpenAI-compatible app: error handlers, the request guard, and one router per route family
(octavo/server/routes/). Routes map HTTP to AsyncEngine calls and RequestOutputs back to JSON/SSE."""

from __future__ import annotations

import logging
import re
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import octavo
from octavo.server.core import APIError, OpenAIServer, ServerLimits
from octavo.server.debug import add_debug_routes
from octavo.server.guard import RequestGuard, error_json
from octavo.server.routes import admin, chat, completions, dashboard, messages, pooling, responses, tokenizer

__all__ = ["APIError", "OpenAIServer", "ServerLimits", "build_app"]

logger = logging.getLogger("octavo.server")


class StripRootPath:
    """Routes answer under a proxy's prefix too (--root-path /llm: /llm/v1/... is /v1/...)."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (path == self.root_path or path.startswith(self.root_path + "/")):
            scope = {**scope, "path": path[len(self.root_path):] or "/", "raw_path": None}
        await self.app(scope, receive, send)


class RequestIdHeader:
    """X-Request-Id on every answer: the client's own, else a new one (--enable-request-id-headers)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, with_header)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|.*\[.*\]|[A-Z][A-Za-z]*)$")


def validation_message(errors: list[dict]) -> tuple[list[str], str]:
    """(the field's path, one message) for pydantic's errors: a validator's own words first (an
    image_url part says it is not supported, not that the content is not a string), the union
    members' type tags dropped from the path, and a union's alternatives named together."""
    if not errors:
        return [], "body: invalid request"
    own = [e for e in errors if e.get("type") == "value_error"]
    first = (own or errors)[0]

    def path(error: dict) -> list[str]:
        return [str(p) for p in error.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]

    loc = path(first)
    if own:
        text = str(first.get("msg", "")).removeprefix("Value error, ")
    else:
        same = list(dict.fromkeys(str(e.get("msg")) for e in errors if path(e) == loc))
        text = " or ".join(same)
    kind = f" [type={first['type']}]" if first.get("type") else ""  # pydantic's error type, as vLLM shows it
    return loc, f"{'.'.join(loc) or 'body'}: {text}{kind}"


def build_app(server: OpenAIServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        server.templates.start()
        yield
        server.engine.shutdown()
        server.executor.shutdown(wait=False, cancel_futures=True)
        server.grammars.close()
        server.templates.close()

    app = FastAPI(title="Octavo", version=octavo.__version__, lifespan=lifespan)
    app.add_middleware(RequestGuard, max_body_bytes=server.limits.max_request_bytes, api_key=server.api_key,
                       body_timeout_s=server.limits.header_timeout_s)
    if server.limits.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    if server.limits.root_path.strip("/"):
        app.add_middleware(StripRootPath, root_path="/" + server.limits.root_path.strip("/"))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.type, exc.param, exc.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return error_json(400, f"malformed JSON body: {errors[0].get('msg')}", "BadRequestError",
                              path=request.url.path)
        loc, message = validation_message(errors)
        return error_json(400, message, "BadRequestError", loc[0] if loc else None, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "APIError")
        return error_json(exc.status_code, str(exc.detail), kind, path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s", request.url.path)
        return error_json(500, f"internal error: {type(exc).__name__}", "InternalServerError", path=request.url.path)

    for family in (admin, tokenizer, completions, chat, messages, responses, pooling, dashboard):
        app.include_router(family.build_router(server))
    add_debug_routes(app, server)
    return app
