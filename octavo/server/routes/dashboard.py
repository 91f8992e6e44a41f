"""The live dashboard: GET /dashboard (the page, package data: plain HTML, CSS and JS), and its
data behind the API key when one is set: /dashboard/snapshot (JSON), /dashboard/events
(server-sent events, about 4 snapshots a second), /dashboard/blocks/{id} (a block's holders and,
only to a caller that holds the API key, its text)."""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, StreamingResponse

from octavo.server.core import APIError, OpenAIServer

_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


class SnapshotHub:
    """One snapshot per interval (--dashboard-interval, 0.25 s: at most 4 a second), shared by
    every viewer: built on the engine thread between steps (AsyncEngine.dashboard_snapshot), serialised once."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.interval_s = server.limits.dashboard_interval_s
        self._lock = asyncio.Lock()
        self._time = 0.0
        self._json = ""

    async def latest(self) -> str:
        async with self._lock:
            if time.monotonic() - self._time >= self.interval_s:
                snap = await self.server.engine.dashboard_snapshot()
                snap["model"] = self.server.model_name
                self._json, self._time = json.dumps(snap, separators=(",", ":")), time.monotonic()
            return self._json


def _static(name: str) -> str:
    return resources.files("octavo.dashboard").joinpath("static", name).read_text()


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    hub = SnapshotHub(server)

    @router.get("/dashboard")
    async def page() -> HTMLResponse:
        return HTMLResponse(_static("dashboard.html"))

    @router.get("/dashboard/static/{name}")
    async def static(name: str) -> PlainTextResponse:
        if name not in _STATIC:
            raise APIError(404, f"no dashboard file {name!r}", "NotFoundError")
        return PlainTextResponse(_static(name), media_type=_STATIC[name])

    @router.get("/dashboard/snapshot")
    async def snapshot() -> PlainTextResponse:
        return PlainTextResponse(await hub.latest(), media_type="application/json")

    @router.get("/dashboard/events")
    async def events(request: Request) -> StreamingResponse:
        async def stream():
            while not await request.is_disconnected():
                yield f"data: {await hub.latest()}\n\n"
                await asyncio.sleep(hub.interval_s)
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/blocks/{block_id}")
    async def block(block_id: int) -> dict[str, Any]:
        found = await server.engine.block_holders(block_id)
        if found is None:
            return {"block_id": block_id, "holders": [], "text": None}
        holders, tokens = found
        # token text only where a key guards the data (the guard has checked it): without one,
        # anybody could read anybody's prompt
        text = server.engine.tokenizer.decode(tokens) if server.api_key else None
        return {"block_id": block_id, "holders": holders, "num_tokens": len(tokens), "text": text}

    return router
