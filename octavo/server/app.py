"""OpenAI-compatible HTTP routes: map requests to AsyncEngine calls and RequestOutputs back to JSON/SSE."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import octavo
from octavo.lora.request import LoRARequest
from octavo.request import RequestOutput, TokenLogprob
from octavo.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStopped,
    OutputCollector,
    merge_deltas,
)
from octavo.server.debug import add_debug_routes
from octavo.server.guard import RequestGuard, error_body, error_json
from octavo.server.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    new_id,
    now,
)
from octavo.tokenizer import apply_chat_template, encode_prompt

logger = logging.getLogger("octavo.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


_PARAM_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logprobs", "stop_token_ids", "stop", "seed", "n",
                "cache_salt", "stream", "length_penalty", "early_stopping", "logit_bias")


def _param_of(message: str) -> str | None:
    return next((p for p in _PARAM_NAMES if message.startswith(p) or f": {p}" in message[:40]), None)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask for; see docs/RELIABILITY.md."""

    max_request_bytes: int = 4 << 20
    retry_after_s: int = 1
    enable_prompt_tokens_details: bool = False
    enable_debug_endpoints: bool = False
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter


class OpenAIServer:
    """Holds what the routes share: the engine, tokenizer, model name, limits and the thread pool
    that keeps tokenisation, chat templating and logprob decoding off the event loop."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
                 limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.model_name = served_model_name
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        config = engine.engine.config
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.priority_enabled = config.scheduler.policy == "priority"
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="octavo-tokenize")
        # adapters by the name a request's `model` field selects (kept in step with the engine)
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in engine.engine.list_loras()}
        self._token_text: dict[int, str] = {}
        # No token decodes to more characters than its vocabulary entry has (byte-level entries
        # spell each byte with one character), so a prompt longer than max_model_len times the
        # longest entry cannot fit and is refused without tokenising it.
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        self.max_chars_per_token = max((len(t) for t in vocab), default=64) + 1

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- checks ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join(f"`{n}`" for n in [self.model_name, *self.loras])
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                           "NotFoundError", "model")
        return lora

    def check_request(self, req: Any) -> LoRARequest | None:
        """Checks a request's fields; returns the LoRA adapter its `model` selects, if any."""
        lora = self.check_model(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], "BadRequestError", bad[0])
        if req.priority != 0 and not self.priority_enabled:
            raise APIError(400, "priority needs a server started with --scheduling-policy priority",
                           "BadRequestError", "priority")
        return lora

    def check_prompt_len(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {len(ids)} tokens; at least one output token must fit.", "BadRequestError", "prompt")

    def check_text_len(self, text: str) -> None:
        if len(text) > self.max_model_len * self.max_chars_per_token:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {len(text)} characters, more than that many tokens can hold.",
                           "BadRequestError", "prompt")

    # ---- off-loop work -----------------------------------------------------------------------

    async def encode(self, prompts: list[str | list[int]]) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                self.check_text_len(p)
                out.append(await self.off_loop(encode_prompt, self.tokenizer, p))
            else:
                out.append(list(p))
        return out

    async def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        self.check_text_len("".join(m["content"] for m in messages))
        try:
            return await self.off_loop(apply_chat_template, self.tokenizer, messages, add_generation_prompt)
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", "BadRequestError", "messages") from exc

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


# ---- disconnects ---------------------------------------------------------------------------


class DisconnectWatch:
    """While open, a task waits for the client's http.disconnect and then calls `on_disconnect`
    (which aborts the request's engine work). Used for the whole life of a request that is not
    streaming yet: queued, prefilling, or collecting a non-streamed answer."""

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self.request, self.on_disconnect = request, on_disconnect
        self.disconnected = False
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self.on_disconnect()
                return

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


# ---- response bodies -----------------------------------------------------------------------


def _completion_logprobs(server: OpenAIServer, lps: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    if lps is None:
        return None
    tokens = [server.token_text(lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{server.token_text(t): v for t, v in lp.top.items()} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(server: OpenAIServer, lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = server.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}


def _usage(server: OpenAIServer, prompts: list[list[int]], num_completion: int,
           outs: list[RequestOutput]) -> dict:
    """The usage object; `outs` holds an output of each prompt (for its cached-token count)."""
    num_prompt = sum(len(p) for p in prompts)
    usage: dict[str, Any] = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                             "total_tokens": num_prompt + num_completion}
    if server.limits.enable_prompt_tokens_details:  # off by default: it tells a tenant what is cached
        usage["prompt_tokens_details"] = {"cached_tokens": sum(out.num_cached_tokens for out in outs)}
    return usage


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _engine_error(exc: Exception, limits: ServerLimits) -> APIError:
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), "RateLimitError", headers={"Retry-After": str(limits.retry_after_s)})
    if isinstance(exc, (EngineStopped, EngineDeadError)):
        return APIError(503, str(exc), "ServiceUnavailableError")
    return APIError(400, str(exc), "BadRequestError", _param_of(str(exc)) or "prompt")


def build_app(server: OpenAIServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        server.engine.shutdown()
        server.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Octavo", version=octavo.__version__, lifespan=lifespan)
    app.add_middleware(RequestGuard, max_body_bytes=server.limits.max_request_bytes, api_key=server.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_json(400, f"malformed JSON body: {first.get('msg')}", "BadRequestError")
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_json(400, message, "BadRequestError", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "APIError")
        return error_json(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s", request.url.path)
        return error_json(500, f"internal error: {type(exc).__name__}", "InternalServerError")

    @app.get("/health")
    async def health() -> Any:
        if not server.engine.is_healthy:
            return error_json(503, "engine is not running", "ServiceUnavailableError")
        return PlainTextResponse("")

    @app.get("/version")
    async def version() -> dict:
        return {"version": octavo.__version__}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(server.engine.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        base = {"id": server.model_name, "object": "model", "created": now(), "owned_by": "octavo",
                "root": server.model_name, "parent": None, "max_model_len": server.max_model_len}
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": server.model_name}
                    for name, lora in server.loras.items()]
        return {"object": "list", "data": [base, *adapters]}

    if server.limits.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            if body.lora_name in server.loras or body.lora_name == server.model_name:
                raise APIError(400, f"a model named `{body.lora_name}` is already served", "BadRequestError", "lora_name")
            known = await server.engine.call(lambda e: e.list_loras())
            lora = LoRARequest(body.lora_name, max((r.lora_int_id for r in known), default=0) + 1, body.lora_path)
            try:
                await server.engine.call(lambda e: e.add_lora(lora))
            except ValueError as exc:
                raise APIError(400, str(exc), "BadRequestError", "lora_path") from exc
            server.loras[lora.lora_name] = lora
            return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            lora = server.loras.get(body.lora_name)
            if lora is None:
                raise APIError(404, f"no LoRA adapter named `{body.lora_name}` is loaded", "NotFoundError", "lora_name")
            try:
                await server.engine.call(lambda e: e.remove_lora(lora.lora_int_id))
            except ValueError as exc:
                raise APIError(400, str(exc), "BadRequestError", "lora_name") from exc
            del server.loras[body.lora_name]
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await server.render_chat(messages, body.add_generation_prompt)
        else:
            ids = (await server.encode([body.prompt or ""]))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        vocab = server.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": await server.off_loop(server.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        lora = server.check_request(req)
        raw = req.prompt_list()
        if not raw:
            raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        if len(raw) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(400, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(raw)}",
                           "BadRequestError", "prompt")
        prompts = await server.encode(raw)
        for ids in prompts:
            server.check_prompt_len(ids)
        if req.use_beam_search:
            try:
                params = req.to_beam_search_params(16)
            except ValueError as exc:
                raise APIError(400, str(exc), "BadRequestError", _param_of(str(exc))) from exc
        else:
            params = _params(req, 16, req.logprobs)
        return await _respond(server, request, req, prompts, params, chat=False, lora=lora)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        lora = server.check_request(req)
        ids = await server.render_chat(req.plain_messages(), req.add_generation_prompt)
        server.check_prompt_len(ids)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        req = req.model_copy(update={"max_tokens": max_tokens})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, server.max_model_len - len(ids), logprobs)
        return await _respond(server, request, req, [ids], params, chat=True, lora=lora)

    add_debug_routes(app, server)
    return app


def _params(req, default_max_tokens: int, logprobs: int | None):
    try:
        return req.to_sampling_params(default_max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), "BadRequestError", _param_of(str(exc))) from exc


async def _respond(server: OpenAIServer, request: Request, req, prompts: list[list[int]], params, chat: bool,
                   lora: LoRARequest | None = None) -> Any:
    rid = new_id("chatcmpl" if chat else "cmpl")
    request_ids = [f"{rid}-{i}" for i in range(len(prompts))]
    async with DisconnectWatch(request, lambda: server.engine.abort(request_ids)) as watch:
        try:
            collector = await server.engine.add(request_ids, prompts, params, req.priority, req.cache_salt, lora)
        except (ValueError, EngineOverloadedError, EngineStopped, EngineDeadError) as exc:
            raise _engine_error(exc, server.limits) from exc
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _stream(server, rid, request_ids, collector, prompts, params, chat, include_usage)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            items = await _collect(collector)
        except (EngineDeadError, EngineStopped) as exc:
            raise _engine_error(exc, server.limits) from exc
        finally:
            if collector.num_open:  # cancelled or failed midway: free what is left
                server.engine.abort(request_ids)
        if watch.disconnected or len(items) < len(prompts) or not all(o.finished for o in items.values()):
            raise APIError(499, "client disconnected", "ClientClosedRequest")
    if params.logprobs is not None:  # decoding every logprob token is work: off the event loop
        return await server.off_loop(_final_body, server, rid, prompts, items, params, chat)
    return _final_body(server, rid, prompts, items, params, chat)


async def _collect(collector: OutputCollector) -> dict[int, RequestOutput]:
    """Every prompt's DELTA outputs merged into its whole output; O(total size)."""
    items: list[tuple[int, RequestOutput]] = []
    while batch := await collector.next_batch():
        items.extend(batch)
    return dict(merge_deltas(items)) if items else {}


def _final_body(server: OpenAIServer, rid: str, prompts, finals: dict[int, RequestOutput], params, chat: bool) -> dict:
    choices = []
    for i in sorted(finals):
        for c in finals[i].outputs:
            index = i * params.n + c.index
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": _chat_logprobs(server, c.logprobs), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": index, "text": c.text, "logprobs": _completion_logprobs(server, c.logprobs),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": server.model_name, "choices": choices, "usage": _usage(server, prompts, sum(len(c.token_ids) for out in finals.values() for c in out.outputs),
                            list(finals.values()))}


async def _stream(server, rid, request_ids, collector, prompts, params, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of the deltas. If the engine dies or the server stops mid-stream, the client gets
    an error event and [DONE] rather than a reset connection."""
    try:
        async for piece in _stream_pieces(server, rid, collector, prompts, params, chat, include_usage):
            yield piece
    except (EngineDeadError, EngineStopped) as exc:
        yield _sse(error_body(503, str(exc), "ServiceUnavailableError"))
        yield "data: [DONE]\n\n"
    finally:
        if collector.num_open:  # a client that went away frees its blocks here
            server.engine.abort(request_ids)


async def _stream_pieces(server, rid, collector: OutputCollector, prompts, params, chat: bool,
                         include_usage: bool) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = now()
    offsets: dict[int, int] = {}  # characters sent per choice, for text_offset
    totals: dict[int, RequestOutput] = {}  # prompt index -> its latest output (cached-token count)
    num_tokens: dict[int, int] = {}

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": server.model_name, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    if chat:
        yield chunk([{"index": i * params.n + k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(prompts)) for k in range(params.n)])
    while batch := await collector.next_batch():
        choices = []
        for i, out in batch:
            totals[i] = out
            for c in out.outputs:
                index = i * params.n + c.index
                num_tokens[index] = num_tokens.get(index, 0) + len(c.token_ids)
                if not c.text and c.finish_reason is None and not c.logprobs:
                    continue
                if chat:
                    choices.append({"index": index, "delta": {"content": c.text} if c.text else {},
                                    "logprobs": _chat_logprobs(server, c.logprobs), "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": index, "text": c.text,
                                    "logprobs": _completion_logprobs(server, c.logprobs, offsets.get(index, 0)),
                                    "finish_reason": c.finish_reason})
                offsets[index] = offsets.get(index, 0) + len(c.text)
        if choices:
            yield chunk(choices)
    if include_usage:
        yield chunk([], _usage(server, prompts, sum(num_tokens.values()), list(totals.values())))
    yield "data: [DONE]\n\n"
