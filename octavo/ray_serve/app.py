"""The Ray Serve deployments: OctavoIngress (HTTP) in front of OctavoReplica (an engine each).

OctavoIngress takes every HTTP request on Ray Serve's proxy and passes it, whole, through a
deployment handle to one OctavoReplica, which runs it through Octavo's own FastAPI app (the same
routes, validation and errors as `octavo serve`) and streams the response back chunk by chunk:
the head first, then the body. The handle's request router (router.KVAwareRequestRouter by
default) picks the replica. A replica that dies before answering is retried on another; one that
dies mid-stream has a greedy stream resumed on another, spliced where the client stopped
(resume.py), and any other stream ended with an error event. Ray restarts replicas whose health check fails (an engine that
died) or whose process is gone, and scales their number on ongoing requests between min_replicas
and max_replicas.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from octavo.ray_serve.resume import ResumeMismatch, StreamSplicer, is_resumable

logger = logging.getLogger("octavo.ray_serve")

MAX_ATTEMPTS = 3  # replicas tried for a request whose replica died before answering
_RETRIED = ("ActorDiedError", "ActorUnavailableError", "RayActorError", "DeploymentUnavailableError")


class OctavoReplica:
    """One engine and Octavo's HTTP app in a Ray actor. `engine_kwargs`: EngineArgs fields."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str | None = None,
                 metrics_prefix: str = "octavo", api_key: str | None = None,
                 enable_prompt_tokens_details: bool = False) -> None:
        import torch

        from octavo.engine import LLMEngine
        from octavo.engine_args import EngineArgs
        from octavo.metrics import EngineMetrics
        from octavo.models.loader import DEFAULT_MODEL_NAME
        from octavo.server.app import OpenAIServer, ServerLimits, build_app
        from octavo.server.async_engine import AsyncEngine

        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        engine_kwargs = {"prefix_caching_hash_algo": "sha256_cbor", **engine_kwargs}
        args = EngineArgs(**engine_kwargs)
        name = served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
        self.engine = AsyncEngine(lambda: LLMEngine.from_args(args), EngineMetrics(name, metrics_prefix))
        self.engine.start()
        import ray

        # answers carry the replica and its Ray node (x-octavo-replica, x-octavo-node)
        self.where = [("x-octavo-replica", serve.get_replica_context().replica_id.unique_id),
                      ("x-octavo-node", ray.get_runtime_context().get_node_id())]
        limits = ServerLimits(enable_prompt_tokens_details=enable_prompt_tokens_details)
        self.app = build_app(OpenAIServer(self.engine, name, api_key, limits))

    async def handle(self, method: str, path: str, body: bytes, parsed: Any,
                     headers: list[tuple[bytes, bytes]]) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through the app: yields {"status", "headers"} then body chunks.
        `parsed`: the body as JSON (what the request router reads), unused here. Closing the
        generator early (the client left) is a disconnect: the engine aborts the request."""
        path, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("ray-serve", 80)}
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self.app(scope, receive, sent.put))
        task.add_done_callback(lambda t: sent.put_nowait(None))
        try:
            while True:
                message = await sent.get()
                if message is None:
                    return
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                                                      for k, v in message.get("headers", [])]
                           + self.where}
                    continue
                # every body chunk already waiting goes as one item: each item crosses Ray as an
                # object of its own, so a consumer behind the engine gets fewer, larger ones
                chunks, more = [], True
                while message is not None and message["type"] == "http.response.body":
                    chunks.append(message.get("body", b""))
                    more = bool(message.get("more_body"))
                    if not more or sent.empty():
                        break
                    message = sent.get_nowait()
                if any(chunks):
                    yield b"".join(chunks)
                if message is None or not more:
                    return
        finally:
            gone.set()
            if not task.done():
                await asyncio.wait({task}, timeout=10)

    def check_health(self) -> None:
        """Ray's health check: an engine that died fails it, and Ray replaces the replica."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine died: {self.engine.error!r}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What KVAwareRequestRouter routes by: the blocks this replica's pool and tier hold."""
        return {"blocks": await self.engine.cached_blocks()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class OctavoIngress:
    """Ray Serve's HTTP entry: every route of `octavo serve`, passed to a replica. Serve's proxy
    hands each request to `__call__` (a plain callable rather than @serve.ingress: every path and
    method goes through unchanged, whatever FastAPI version sits beside Ray)."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.lstrip("/")
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except (ValueError, RecursionError):
            parsed = None
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        request_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]

        def call():
            return self.replicas.options(stream=True).handle.remote(request.method, target, body, parsed,
                                                                    request_headers)

        opened = await _open(call)
        if isinstance(opened, BaseException):
            return JSONResponse({"error": {"message": f"no replica answered: {opened!r}",
                                           "type": "ServiceUnavailableError"}}, 503, headers={"Retry-After": "1"})
        head, stream = opened
        if head is None:
            return JSONResponse({"error": {"message": "the replica sent no response", "type": "APIError"}}, 502)
        headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        resume = call if sse and head["status"] == 200 and is_resumable(path, parsed) else None
        return StreamingResponse(_relay(stream, sse, resume), status_code=head["status"], headers=headers)


async def _open(call) -> tuple[dict | None, Any] | BaseException:
    """(the response head, the stream) from the first replica that answers, up to MAX_ATTEMPTS
    (a replica that died before answering is replaced by another); the last error if none did."""
    last: BaseException = RuntimeError("no attempt")
    for attempt in range(MAX_ATTEMPTS):
        stream = call()
        try:
            return await stream.__anext__(), stream
        except StopAsyncIteration:
            return None, stream
        except Exception as exc:
            if type(exc).__name__ not in _RETRIED:
                raise
            last = exc
            logger.warning("replica gone before answering (%s); attempt %d of %d", type(exc).__name__,
                           attempt + 1, MAX_ATTEMPTS)
    return last


async def _relay(stream, sse: bool, resume) -> AsyncIterator[bytes]:
    """The body's chunks. A replica that dies mid-stream: a greedy stream (`resume`: how to ask
    again) goes on from another replica, spliced so the client sees one stream (resume.py);
    otherwise an SSE stream ends with an error event (what OpenAI's clients raise), never a
    silent cut that looks like a short answer."""
    splicer = StreamSplicer() if resume is not None else None
    attempts = 0
    try:
        while True:
            try:
                async for chunk in stream:
                    yield splicer.take(chunk) if splicer is not None else chunk
                return
            except Exception as exc:
                if type(exc).__name__ not in _RETRIED and not isinstance(exc, ResumeMismatch):
                    raise
                logger.warning("replica gone mid-stream: %s", type(exc).__name__)
                attempts += 1
                opened = None
                if splicer is not None and attempts < MAX_ATTEMPTS and not isinstance(exc, ResumeMismatch):
                    stream.cancel()
                    opened = await _open(resume)
                if isinstance(opened, tuple) and opened[0] is not None and opened[0]["status"] == 200:
                    stream = opened[1]
                    splicer.restart()
                    logger.warning("stream resumed on another replica after %d characters", len(splicer.delivered))
                    continue
                if sse:
                    error = {"error": {"message": f"the replica serving this stream died ({type(exc).__name__}); "
                                       "retry the request", "type": "ServiceUnavailableError", "code": 503}}
                    yield f"data: {json.dumps(error)}\n\n".encode()
                return
    finally:
        stream.cancel()


def build_app(args: dict[str, Any]):
    """The application builder `serve run octavo.ray_serve:build_app key=value ...` calls (Ray
    passes the key=value pairs as strings; a YAML config's `args` keep their types). Keys:
    min_replicas, max_replicas (autoscaling; default 1 and 2), num_replicas (a fixed number
    instead), target_ongoing_requests (default 8), num_cpus (per replica; default 1: also its
    torch threads), max_ongoing_requests (default 64), router (kv-aware, the default, or
    power-of-two: Ray's own), served_model_name, metrics_prefix, api_key, upscale_delay_s,
    downscale_delay_s, enable_prompt_tokens_details; every other key is an engine option (EngineArgs: model, kv_cache_memory,
    max_model_len, ...)."""
    from octavo.engine_args import EngineArgs

    args = dict(args)
    deployment_keys = ("min_replicas", "max_replicas", "num_replicas", "target_ongoing_requests", "num_cpus",
                       "max_ongoing_requests", "router", "served_model_name", "metrics_prefix", "api_key",
                       "upscale_delay_s", "downscale_delay_s", "enable_prompt_tokens_details")
    opts = {k: args.pop(k) for k in deployment_keys if k in args}
    engine_kwargs = _engine_kwargs(args, EngineArgs)
    num_cpus = float(opts.get("num_cpus", 1))
    replica_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus,
                              "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(num_cpus)))}}},
        "max_ongoing_requests": int(opts.get("max_ongoing_requests", 64)),
        "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
    }
    if "num_replicas" in opts:
        replica_options["num_replicas"] = int(opts["num_replicas"])
    else:
        replica_options["autoscaling_config"] = {
            "min_replicas": int(opts.get("min_replicas", 1)), "max_replicas": int(opts.get("max_replicas", 2)),
            "target_ongoing_requests": float(opts.get("target_ongoing_requests", 8)),
            "upscale_delay_s": float(opts.get("upscale_delay_s", 5)),
            "downscale_delay_s": float(opts.get("downscale_delay_s", 30))}
    if opts.get("router", "kv-aware") == "kv-aware":
        from octavo.ray_serve.router import KVAwareRequestRouter

        replica_options["request_router_config"] = RequestRouterConfig(
            request_router_class=KVAwareRequestRouter, request_routing_stats_period_s=1.0,
            request_router_kwargs={"model": engine_kwargs.get("model"),
                                   "block_size": int(engine_kwargs.get("block_size", 16))})
    elif opts["router"] != "power-of-two":
        raise ValueError(f"router must be kv-aware or power-of-two, got {opts['router']!r}")
    replica = serve.deployment(OctavoReplica).options(**replica_options).bind(
        engine_kwargs, opts.get("served_model_name"), opts.get("metrics_prefix", "octavo"), opts.get("api_key"),
        str(opts.get("enable_prompt_tokens_details", False)).lower() in ("1", "true", "yes"))
    ingress = serve.deployment(OctavoIngress).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    return ingress.bind(replica)


def _engine_kwargs(args: dict[str, Any], engine_args_cls) -> dict[str, Any]:
    """EngineArgs fields from builder args; strings (from `serve run k=v`) converted to each
    field's type; ValueError naming an unknown key."""
    import dataclasses

    from octavo.cli import parse_bytes

    fields = {f.name: f for f in dataclasses.fields(engine_args_cls)}
    out = {}
    for key, value in args.items():
        if key not in fields:
            raise ValueError(f"unknown option {key!r} for octavo.ray_serve:build_app (engine options: EngineArgs fields)")
        kind = str(fields[key].type)
        if isinstance(value, str) and value != "None":
            if fields[key].metadata.get("bytes"):
                value = parse_bytes(value)
            elif kind.startswith("int"):
                value = int(value)
            elif kind.startswith("float"):
                value = float(value)
            elif kind.startswith("bool"):
                value = value.lower() in ("1", "true", "yes")
        out[key] = None if value == "None" else value
    return out
