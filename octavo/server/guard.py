"""RequestGuard: the ASGI layer in front of every route: API key and request-size limit.

It reads the body itself, up to `max_body_bytes` (a larger body, announced or streamed, gets a 413
before any route parses it), then replays it to the app; later `receive` calls pass through, so
routes still see the client's disconnect.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi.responses import JSONResponse


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_json(status: int, message: str, type_: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status, headers=headers)


async def _send_error(send: Any, status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, type_)).encode()
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


class RequestGuard:
    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].startswith("/v1"):
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
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, too_large, "RequestTooLargeError")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
