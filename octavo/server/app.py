"""OpenAI-compatible HTTP routes: map requests to AsyncEngine calls and RequestOutputs back to JSON/SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import octavo
from octavo.request import RequestOutput, TokenLogprob
from octavo.server.async_engine import AsyncEngine, EngineStopped
from octavo.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from octavo.tokenizer import apply_chat_template, encode_prompt


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_json(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status_code=status)


_PARAM_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logprobs", "stop_token_ids", "stop", "seed", "n")


def _param_of(message: str) -> str | None:
    return next((p for p in _PARAM_NAMES if message.startswith(p)), None)


class OpenAIServer:
    """Holds what the routes share: the engine, tokenizer, model name and limits."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.model_name = served_model_name
        self.api_key = api_key
        self.max_model_len = engine.engine.config.scheduler.max_model_len

    # ---- helpers -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError", "model")

    def check_prompt_len(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {len(ids)} tokens; at least one output token must fit.", "BadRequestError", "prompt")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def run(self, request: Request, prompts: list[list[int]], params, priority: int, salt: str | None
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt, interleaved as they come: (prompt index, output)."""
        base = new_id("req")
        gens = [self.engine.generate(f"{base}-{i}", ids, params, priority, salt) for i, ids in enumerate(prompts)]
        if len(gens) == 1:
            async for out in gens[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for out in gen:
                    await queue.put((i, out))
            except BaseException as exc:  # includes a refusal
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            open_count = len(tasks)
            while open_count:
                i, item = await queue.get()
                if item is None:
                    open_count -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def start_stream(self, request: Request, prompts, params, priority, salt):
        """Start generation and wait for the engine to accept every prompt, so that a refusal is an
        HTTP error rather than a broken stream. Returns (first item, iterator)."""
        it = self.run(request, prompts, params, priority, salt).__aiter__()
        try:
            first = await it.__anext__()
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", _param_of(str(exc)) or "prompt") from exc
        except EngineStopped as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from exc
        return first, it


def _completion_logprobs(server: OpenAIServer, lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None
    tokens = [server.token_text(lp.token_id) for lp in lps]
    offsets, pos = [], 0
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


def _usage(prompts: list[list[int]], finals: dict[int, RequestOutput]) -> dict:
    num_prompt = sum(len(p) for p in prompts)
    num_completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals.values())
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


def build_app(server: OpenAIServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        server.engine.shutdown()

    app = FastAPI(title="Octavo", version=octavo.__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.type, exc.param)

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
        return error_json(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else "APIError")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_json(500, f"internal error: {exc}", "InternalServerError")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {server.api_key}":
                return error_json(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "AuthenticationError")
        return await call_next(request)

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
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": now(),
                                            "owned_by": "octavo", "max_model_len": server.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: dict) -> dict:
        if "messages" in body:
            ids = apply_chat_template(server.tokenizer, body["messages"], body.get("add_generation_prompt", True))
        elif isinstance(body.get("prompt"), str):
            ids = encode_prompt(server.tokenizer, body["prompt"])
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'", "BadRequestError", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: dict) -> dict:
        tokens = body.get("tokens")
        vocab = server.engine.engine.config.model_config.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": server.tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        server.check_model(req.model)
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # type: ignore[list-item]
        if not raw:
            raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        prompts = [encode_prompt(server.tokenizer, p) if isinstance(p, str) else list(p) for p in raw]
        for ids in prompts:
            server.check_prompt_len(ids)
        params = _params(req, 16, req.logprobs)
        return await _respond(server, request, req, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        server.check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = apply_chat_template(server.tokenizer, messages, req.add_generation_prompt)
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", "BadRequestError", "messages") from exc
        server.check_prompt_len(ids)
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, server.max_model_len - len(ids), logprobs)
        return await _respond(server, request, req, [ids], params, chat=True)

    return app


def _params(req, default_max_tokens: int, logprobs: int | None):
    try:
        return req.to_sampling_params(default_max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), "BadRequestError", _param_of(str(exc))) from exc


async def _respond(server: OpenAIServer, request: Request, req, prompts: list[list[int]], params, chat: bool) -> Any:
    first, it = await server.start_stream(request, prompts, params, req.priority, req.cache_salt)
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(server, rid, first, it, prompts, params, chat, include_usage),
                                 media_type="text/event-stream")
    finals = await _collect_unless_disconnected(request, first, it)
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
            "model": server.model_name, "choices": choices, "usage": _usage(prompts, finals)}


async def _collect_unless_disconnected(request: Request, first, it) -> dict[int, RequestOutput]:
    """Final outputs per prompt; if the client goes away first, the requests are aborted."""

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        item = first
        while item is not None:
            i, out = item
            if out.finished:
                finals[i] = out
            item = await anext(it, None)
        return finals

    task = asyncio.create_task(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "ClientClosedRequest")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await it.aclose()


async def _stream(server, rid, first, it, prompts, params, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    try:
        async for piece in _stream_pieces(server, rid, first, it, prompts, params, chat, include_usage):
            yield piece
    finally:
        await it.aclose()  # a client that went away aborts its requests here, freeing their blocks


async def _stream_pieces(server, rid, first, it, prompts, params, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = now()
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": server.model_name, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    if chat:
        yield chunk([{"index": i * params.n + k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(prompts)) for k in range(params.n)])
    item = first
    while item is not None:
        i, out = item
        if out.finished:
            finals[i] = out
        choices = []
        for c in out.outputs:
            index = i * params.n + c.index
            if index in finished:
                continue
            delta = c.text[sent_text.get(index, 0):]
            new_lps = c.logprobs[sent_tokens.get(index, 0):] if c.logprobs is not None else None
            if not delta and c.finish_reason is None and not new_lps:
                continue
            sent_text[index] = len(c.text)
            sent_tokens[index] = len(c.token_ids)
            if chat:
                choices.append({"index": index, "delta": {"content": delta} if delta else {},
                                "logprobs": _chat_logprobs(server, new_lps), "finish_reason": c.finish_reason})
            else:
                choices.append({"index": index, "text": delta, "logprobs": _completion_logprobs(server, new_lps),
                                "finish_reason": c.finish_reason})
            if c.finish_reason is not None:
                finished.add(index)
        if choices:
            yield chunk(choices)
        item = await anext(it, None)
    if include_usage:
        yield chunk([], _usage(prompts, finals))
    yield "data: [DONE]\n\n"
