"""The router's HTTP side: OpenAI routes proxied to the chosen replica (streams passed through,
a client's disconnect closes the upstream request so the replica aborts it), health checks that
take a dead replica out and put it back, and /metrics of its own.

Made so that one bad replica or client cannot hold the others up: each replica has its own
connection pool (a hung replica fills only its own), waiting for a free connection of it has a
deadline after which another replica is tried, a response's head must come within
`request_timeout_s`, a client that leaves while its request waits frees the upstream connection at
once, health checks have a client of their own, and bodies pass the server's RequestGuard (size
limit: 413; nesting limit: 400) before anything is read into memory whole. A body the router
cannot read a prompt from is still passed on, for the replica to answer (400) in its own words.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from octavo.router.policy import Choice, Router
from octavo.server.guard import RequestGuard, error_json

logger = logging.getLogger("octavo.router")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def prompt_text(body: Any) -> str:
    """The text a request's prefix is matched on: its prompt, or its messages' contents in order
    ("" for a body of another shape: the replica will say what is wrong with it)."""
    if not isinstance(body, dict):
        return ""
    try:
        if "messages" in body:
            parts = []
            for m in body.get("messages") or []:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):
                    content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                role = m.get("role", "") if isinstance(m, dict) else ""
                parts.append(f"{role}:{content or ''}\n")
            return "".join(parts)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    except (TypeError, ValueError, RecursionError):
        return ""


def prompt_token_ids(body: Any, tokenizer: Any) -> list[int]:
    """The token ids a replica computes for a request, as its server makes them: a chat's messages
    through the model's chat template, a prompt encoded with special tokens, token ids as given
    ([] for a body of another shape, or one the template refuses)."""
    from octavo.tokenizer import apply_chat_template, encode_prompt

    if not isinstance(body, dict):
        return []
    try:
        if "messages" in body:
            return apply_chat_template(tokenizer, body["messages"], body.get("add_generation_prompt", True),
                                       tools=body.get("tools"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode_prompt(tokenizer, prompt, body.get("add_special_tokens", True) is not False)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    except Exception:  # whatever the template makes of a strange body, the replica will say in its answer
        return []
    return []


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("octavo_router_requests", "requests sent to each replica", ["worker"], registry=self.registry)
        self.hits = Counter("octavo_router_cache_hits", "requests sent where a prefix was already sent", ["worker"],
                            registry=self.registry)
        self.matched = Counter("octavo_router_matched_chars", "prompt characters already sent to the replica",
                               ["worker"], registry=self.registry)
        self.matched_blocks = Counter("octavo_router_matched_blocks", "prompt blocks the replica reported holding "
                                      "(kv-events)", ["worker"], registry=self.registry)
        self.healthy = Gauge("octavo_router_worker_healthy", "1 while the replica passes its health check", ["worker"],
                             registry=self.registry)
        self.in_flight = Gauge("octavo_router_in_flight", "requests open at each replica", ["worker"], registry=self.registry)


def _passed_headers(request: Request) -> dict[str, str]:
    """What goes upstream: the body's type and the client's credentials (replicas check the key)."""
    headers = {"Content-Type": "application/json"}
    if "authorization" in request.headers:
        headers["Authorization"] = request.headers["authorization"]
    return headers


class _Proxy:
    """The router's state and its forwarding: a pool of connections per replica, health checks,
    metrics; one POST is sent to the chosen replica and its answer streamed back."""

    def __init__(self, router: Router, health_interval: float, request_timeout_s: float,
                 max_connections_per_replica: int, pool_timeout_s: float,
                 prompt_blocks: Callable[[Any], list[int]] | None = None) -> None:
        self.router, self.health_interval, self.request_timeout_s = router, health_interval, request_timeout_s
        self.prompt_blocks = prompt_blocks
        self.metrics = RouterMetrics()
        for r in router.replicas:
            self.metrics.healthy.labels(r.url).set(1)
        # read=None: a stream may pause between tokens for as long as the replica queues it; the wait
        # for a response's head is bounded by request_timeout_s in forward()
        self.clients = {r.url: httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0, pool=pool_timeout_s),
            limits=httpx.Limits(max_connections=max_connections_per_replica, max_keepalive_connections=32),
        ) for r in router.replicas}
        self.health_client = httpx.AsyncClient(timeout=5.0)

    async def check_health(self) -> None:
        while True:
            for r in self.router.replicas:
                try:
                    ok = (await self.health_client.get(f"{r.url}/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok != r.healthy:
                    logger.warning("replica %s is %s", r.url, "back" if ok else "down")
                r.healthy = ok
                self.metrics.healthy.labels(r.url).set(int(ok))
            await asyncio.sleep(self.health_interval)

    async def close(self) -> None:
        for c in [*self.clients.values(), self.health_client]:
            await c.aclose()

    @staticmethod
    def no_replica(why: str = "no healthy replica") -> JSONResponse:
        return error_json(503, why, "ServiceUnavailableError", headers={"Retry-After": "1"})

    async def send_until_disconnect(self, request: Request, replica_url: str,
                                    upstream: httpx.Request) -> httpx.Response | None:
        """The replica's response (its head), or None if the client left first (the upstream
        request is then cancelled, which closes its connection). TimeoutError past request_timeout_s."""
        sending = asyncio.ensure_future(self.clients[replica_url].send(upstream, stream=True))
        leaving = asyncio.ensure_future(_client_leaves(request))
        try:
            done, _ = await asyncio.wait({sending, leaving}, timeout=self.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not sending.done():
                sending.cancel()
        if sending in done:
            return sending.result()
        if leaving in done:
            return None
        raise TimeoutError

    async def forward(self, path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        text = prompt_text(body)
        key = body.get("prompt_cache_key") if isinstance(body, dict) else None
        key = key if isinstance(key, str) and key else None
        blocks = None if self.prompt_blocks is None else await asyncio.to_thread(self.prompt_blocks, body)
        tried: set[str] = set()
        while True:
            choice = self.router.choose(text, exclude=tried, key=key, blocks=blocks)
            if choice is None:
                return self.no_replica("no healthy replica" if not tried else f"no replica answered (tried {len(tried)})")
            replica = choice.replica
            tried.add(replica.url)
            upstream = self.clients[replica.url].build_request("POST", f"{replica.url}{path}", content=raw,
                                                               headers=_passed_headers(request))
            # open from now: a request counts as the replica's load while it computes its first
            # token too (a whole answer, when not streamed), not only once the answer starts
            self._opened(replica, +1)
            try:
                response = await self.send_until_disconnect(request, replica.url, upstream)
            except httpx.PoolTimeout:  # its connections are all busy (hung?): another replica, if any
                self._opened(replica, -1)
                logger.warning("replica %s has no free connection; trying another", replica.url)
                continue
            except httpx.TransportError:  # connection refused or reset: out until a health check says otherwise
                self._opened(replica, -1)
                replica.healthy = False
                self.metrics.healthy.labels(replica.url).set(0)
                continue
            except BaseException as exc:
                self._opened(replica, -1)
                if isinstance(exc, TimeoutError):
                    return error_json(504, f"the replica did not answer within {self.request_timeout_s:g} s",
                                      "GatewayTimeoutError")
                raise
            if response is None:
                self._opened(replica, -1)
                return Response(status_code=499)  # nobody is there to read it
            return self.stream_back(replica, choice, response)

    def _opened(self, replica, change: int) -> None:
        replica.in_flight += change
        self.metrics.in_flight.labels(replica.url).set(replica.in_flight)

    def stream_back(self, replica, choice: Choice, response: httpx.Response) -> StreamingResponse:
        metrics = self.metrics
        metrics.requests.labels(replica.url).inc()
        if choice.matched_chars or choice.matched_blocks:
            metrics.hits.labels(replica.url).inc()
            metrics.matched.labels(replica.url).inc(choice.matched_chars)
            metrics.matched_blocks.labels(replica.url).inc(choice.matched_blocks)

        async def body():
            try:
                async for piece in response.aiter_raw():
                    yield piece
            finally:  # also when the client went away: closing the upstream aborts it there
                await response.aclose()
                self._opened(replica, -1)

        kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after")}
        return StreamingResponse(body(), status_code=response.status_code, headers=kept)


def build_router_app(router: Router, health_interval: float = 2.0, request_timeout_s: float = 1800.0,
                     max_connections_per_replica: int = 256, pool_timeout_s: float = 5.0,
                     max_request_bytes: int = 4 << 20, prompt_blocks: Callable[[Any], list[int]] | None = None,
                     listener: Any = None) -> FastAPI:
    """`prompt_blocks` and `listener` (kv-events): a request body -> its block hashes, and the
    KVEventListener feeding the router's index (started and stopped with the app)."""
    proxy = _Proxy(router, health_interval, request_timeout_s, max_connections_per_replica, pool_timeout_s, prompt_blocks)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(proxy.check_health())
        if listener is not None:
            listener.start()
        yield
        task.cancel()
        if listener is not None:
            listener.stop()
        await proxy.close()

    app = FastAPI(title="Octavo router", lifespan=lifespan)
    app.add_middleware(RequestGuard, max_body_bytes=max_request_bytes)
    for route in ROUTES:
        async def handler(request: Request, _route: str = route) -> Response:
            return await proxy.forward(_route, request)
        app.post(route)(handler)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for r in router.healthy():
            try:
                resp = await proxy.clients[r.url].get(f"{r.url}/v1/models", headers=_passed_headers(request), timeout=10.0)
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return proxy.no_replica()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if router.healthy() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        index = router.kv_index
        return {"policy": router.policy, "workers": [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "tree_nodes": len(r.tree.nodes),
             **({"kv_blocks": index.num_blocks(r.url)} if index is not None else {})}
            for r in router.replicas],
            **({"hashing_differently": index.disagreeing()} if index is not None else {})}

    return app


async def _client_leaves(request: Request) -> None:
    """Returns when the client disconnects (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
