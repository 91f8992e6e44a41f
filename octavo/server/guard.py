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


def error_json(status: int, message: str, type_: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status, headers=headers)


async def _send_error(send: Any, status: int, message: str, type_: str, headers: dict[str, str] | None = None,
                      param: str | None = None) -> None:
    body = json.dumps(error_body(status, message, type_, param)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def bearer_token_matches(header: str | None, api_key: str) -> bool:
    """'Bearer <key>' with the scheme in any case; the key compared in constant time."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def needs_key(path: str) -> bool:
    """The API and the dashboard's data need the API key (when one is set); the dashboard's page
    and its script hold no data (the page asks for the key), nor do /health and /metrics' counts."""
    if path.startswith("/dashboard/"):
        return not path.startswith("/dashboard/static/")
    return path.startswith("/v1")


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
        if self.api_key and needs_key(scope["path"]):
            if not bearer_token_matches(headers.get("authorization"), self.api_key):
                await _send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  "AuthenticationError", {"WWW-Authenticate": "Bearer"})
                return
        too_large = f"the request body is larger than the limit of {self.max_body_bytes} bytes (--max-request-bytes)"
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _send_error(send, 413, too_large, "RequestTooLargeError")
            return
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                await _send_error(send, 408, f"the request body stopped arriving for {self.body_timeout_s:g} s",
                                  "RequestTimeoutError")
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, too_large, "RequestTooLargeError")
                return
            if not message.get("more_body", False):
                break
        # a big body's scan runs off the event loop (a 4 MiB body of brackets takes ~1 s)
        nested = json_nesting_error(body) if len(body) < 1 << 16 else await asyncio.to_thread(json_nesting_error, bytes(body))
        if nested is not None:
            await _send_error(send, 400, nested, "BadRequestError", param=nested.split(":", 1)[0])
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
