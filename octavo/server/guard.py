"""RequestGuard: the ASGI layer in front of every route: API key, request-size and nesting limits.

It reads the body itself, up to `max_body_bytes` (a larger body, announced or streamed, gets a 413
before any route parses it), refuses JSON nested deeper than MAX_JSON_DEPTH (400 naming the
top-level field: deeper values overflow the recursion of whatever walks them later), then replays
it to the app; later `receive` calls pass through, so routes still see the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from fastapi.responses import JSONResponse

from octavo.json_limits import json_nesting_error


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


# Anthropic's error types by status (its API's errors page)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """The Anthropic error shape (for /v1/messages)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                                                        else "api_error"), "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_json(status: int, message: str, type_: str, param: str | None = None,
               headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    body = anthropic_error_body(status, message) if is_anthropic_path(path) else error_body(status, message, type_, param)
    return JSONResponse(body, status_code=status, headers=headers)


async def _send_error(send: Any, status: int, message: str, type_: str, headers: dict[str, str] | None = None,
                      param: str | None = None, path: str = "") -> None:
    body = json.dumps(anthropic_error_body(status, message) if is_anthropic_path(path)
                      else error_body(status, message, type_, param)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def api_key_matches(headers: dict[str, str], api_key: str) -> bool:
    """'Authorization: Bearer <key>', or Anthropic's 'x-api-key: <key>'."""
    if bearer_token_matches(headers.get("authorization"), api_key):
        return True
    given = headers.get("x-api-key")
    return given is not None and secrets.compare_digest(given.strip().encode(), api_key.encode())


def bearer_token_matches(header: str | None, api_key: str) -> bool:
    """'Bearer <key>' with the scheme in any case; the key compared in constant time."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


# Routes open without the key: the probes and counters (as vLLM keeps /health and /metrics open
# for load balancers and Prometheus), the version, FastAPI's schema pages, and the dashboard's
# page and script (they hold no data; the page asks for the key). Each answers from memory, with
# no tokenizer or engine work, so a keyless flood of them cannot starve keyed requests.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/docs", "/redoc", "/openapi.json", "/dashboard"})


def needs_key(path: str) -> bool:
    """Whether a route needs the API key (when one is set): every route but OPEN_PATHS, /tokenize,
    /detokenize and /tokenizer_info included (they share the tokenizer's threads with keyed work)."""
    return not (path in OPEN_PATHS or path.startswith("/dashboard/static/"))


def invocation_route(body: bytes) -> str:
    """The route a POST /invocations body is for, by its fields: messages -> chat, prompt ->
    completions, input -> embeddings (an unreadable body goes to chat, which says what is wrong)."""
    try:
        keys = json.loads(body)
    except ValueError:
        return "/v1/chat/completions"
    if isinstance(keys, dict) and "messages" not in keys:
        if "prompt" in keys:
            return "/v1/completions"
        if "input" in keys:
            return "/v1/embeddings"
    return "/v1/chat/completions"


class RequestGuard:
    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None = None, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.body_timeout_s = body_timeout_s  # the longest pause between two pieces of a body (then 408)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        if self.api_key and needs_key(scope["path"]):
            if not api_key_matches(headers, self.api_key):
                await _send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                                  "(or 'x-api-key: <key>')", "AuthenticationError", {"WWW-Authenticate": "Bearer"},
                                  path=path)
                return
        too_large = f"the request body is larger than the limit of {self.max_body_bytes} bytes (--max-request-bytes)"
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _send_error(send, 413, too_large, "RequestTooLargeError", path=path)
            return
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                await _send_error(send, 408, f"the request body stopped arriving for {self.body_timeout_s:g} s",
                                  "RequestTimeoutError", path=path)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, too_large, "RequestTooLargeError", path=path)
                return
            if not message.get("more_body", False):
                break
        # a big body's scan runs off the event loop (a 4 MiB body of brackets takes ~1 s)
        nested = json_nesting_error(body) if len(body) < 1 << 16 else await asyncio.to_thread(json_nesting_error, bytes(body))
        if nested is not None:
            await _send_error(send, 400, nested, "BadRequestError", param=nested.split(":", 1)[0], path=path)
            return
        if path == "/invocations" and scope.get("method") == "POST":  # SageMaker's entry point (vLLM serves it)
            scope = {**scope, "path": invocation_route(body), "raw_path": None}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
