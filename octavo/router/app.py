"""The router's HTTP side: OpenAI routes proxied to the chosen replica (streams passed through,
a client's disconnect closes the upstream request so the replica aborts it), health checks that
take a dead replica out and put it back, and /metrics of its own."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from octavo.router.policy import Choice, Router

logger = logging.getLogger("octavo.router")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def prompt_text(body: dict) -> str:
    """The text a request's prefix is matched on: its prompt, or its messages' contents in order."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''}:{content or ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("octavo_router_requests", "requests sent to each replica", ["worker"], registry=self.registry)
        self.hits = Counter("octavo_router_cache_hits", "requests sent where a prefix was already sent", ["worker"],
                            registry=self.registry)
        self.matched = Counter("octavo_router_matched_chars", "prompt characters already sent to the replica",
                               ["worker"], registry=self.registry)
        self.healthy = Gauge("octavo_router_worker_healthy", "1 while the replica passes its health check", ["worker"],
                             registry=self.registry)
        self.in_flight = Gauge("octavo_router_in_flight", "requests open at each replica", ["worker"], registry=self.registry)


def _passed_headers(request: Request) -> dict[str, str]:
    """What goes upstream: the body's type and the client's credentials (replicas check the key)."""
    headers = {"Content-Type": "application/json"}
    if "authorization" in request.headers:
        headers["Authorization"] = request.headers["authorization"]
    return headers


def build_router_app(router: Router, health_interval: float = 2.0) -> FastAPI:
    metrics = RouterMetrics()
    for r in router.replicas:
        metrics.healthy.labels(r.url).set(1)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def check_health() -> None:
        while True:
            for r in router.replicas:
                try:
                    ok = (await client.get(f"{r.url}/health", timeout=5.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok != r.healthy:
                    logger.warning("replica %s is %s", r.url, "back" if ok else "down")
                r.healthy = ok
                metrics.healthy.labels(r.url).set(int(ok))
            await asyncio.sleep(health_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(check_health())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="Octavo router", lifespan=lifespan)

    def no_replica() -> JSONResponse:
        return JSONResponse({"error": {"message": "no healthy replica", "type": "ServiceUnavailableError",
                                       "param": None, "code": 503}}, status_code=503)

    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        text = prompt_text(body) if isinstance(body, dict) else ""
        tried: set[str] = set()
        while True:
            choice = router.choose(text, exclude=tried)
            if choice is None:
                return no_replica()
            replica = choice.replica
            tried.add(replica.url)
            upstream = client.build_request("POST", f"{replica.url}{path}", content=raw,
                                            headers=_passed_headers(request))
            try:
                response = await client.send(upstream, stream=True)
            except httpx.TransportError:  # connection refused or reset: out until a health check says otherwise
                replica.healthy = False
                metrics.healthy.labels(replica.url).set(0)
                continue
            return stream_back(replica, choice, response)

    def stream_back(replica, choice: Choice, response: httpx.Response) -> StreamingResponse:
        replica.in_flight += 1
        metrics.requests.labels(replica.url).inc()
        metrics.in_flight.labels(replica.url).set(replica.in_flight)
        if choice.matched_chars:
            metrics.hits.labels(replica.url).inc()
            metrics.matched.labels(replica.url).inc(choice.matched_chars)

        async def body():
            try:
                async for piece in response.aiter_raw():
                    yield piece
            finally:  # also when the client went away: closing the upstream aborts it there
                await response.aclose()
                replica.in_flight -= 1
                metrics.in_flight.labels(replica.url).set(replica.in_flight)

        kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after")}
        return StreamingResponse(body(), status_code=response.status_code, headers=kept)

    for route in ROUTES:
        async def handler(request: Request, _route: str = route) -> Response:
            return await forward(_route, request)
        app.post(route)(handler)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for r in router.healthy():
            try:
                resp = await client.get(f"{r.url}/v1/models", headers=_passed_headers(request), timeout=10.0)
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return no_replica()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if router.healthy() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        return {"policy": router.policy, "workers": [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "tree_nodes": len(r.tree.nodes)}
            for r in router.replicas]}

    return app
