"""A request's life on the engine, one for every route: `submitted` adds its prompts (engine
refusals become the right HTTP errors) and watches for the client leaving (which aborts the
engine work); then `collect_all` waits for the whole answer (499 if the client left), or
`guarded_stream` passes a stream's pieces on (the engine dying mid-stream becomes the route's
error event; what is left is aborted). `run_request` answers completions and chat with these,
through the route's `Choices` (text for completions, messages and tool calls for chat);
routes/responses.py writes the Responses API's events with the same three."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from octavo.lora.request import LoRARequest
from octavo.request import CompletionOutput, RequestOutput
from octavo.output_processor import merge_deltas
from octavo.server.async_engine import EngineDeadError, EngineOverloadedError, EngineStopped, OutputCollector
from octavo.server.core import APIError, DisconnectWatch, OpenAIServer, engine_error
from octavo.server.guard import error_body
from octavo.server.protocol import new_id, now


class Choices(Protocol):
    """Writes one route's choices. `final` gets a whole completion; `delta` a streamed piece and
    returns the choice chunks to send for it (possibly none)."""

    object_name: str
    chunk_name: str

    def final(self, index: int, out: RequestOutput, c: CompletionOutput) -> dict: ...

    def delta(self, index: int, out: RequestOutput, c: CompletionOutput) -> list[dict]: ...

    def first_chunks(self, num_choices: int) -> list[dict]: ...

    def stream_start_fields(self, prompts: list[list[int]]) -> dict: ...

    def extra_fields(self, finals: dict[int, RequestOutput]) -> dict: ...


def usage(server: OpenAIServer, prompts: list[list[int]], num_completion: int, outs: list[RequestOutput]) -> dict:
    """The usage object; `outs` holds an output of each prompt (for its cached-token count)."""
    num_prompt = sum(len(p) for p in prompts)
    body: dict[str, Any] = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                            "total_tokens": num_prompt + num_completion}
    if server.limits.enable_prompt_tokens_details:  # off by default: it tells a tenant what is cached
        body["prompt_tokens_details"] = {"cached_tokens": sum(out.num_cached_tokens for out in outs)}
    return body


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


@dataclass(slots=True)
class Submitted:
    """One HTTP request's prompts in the engine."""

    rid: str  # the response's id; prompt i runs as f"{rid}-{i}" (one prompt: rid itself, if asked)
    request_ids: list[str]
    collector: OutputCollector
    watch: DisconnectWatch


@contextlib.asynccontextmanager
async def submitted(server: OpenAIServer, request: Request, prompts: list[list[int]], params: Any, priority: int,
                    cache_salt: str | None, lora: LoRARequest | None, id_prefix: str,
                    one_id: bool = False) -> AsyncIterator[Submitted]:
    """Add the prompts; while open, a client that leaves aborts them. A refusal (bad input, full
    queue, engine stopped or dead) raises the APIError that says so, and nothing stays queued."""
    rid = new_id(id_prefix)
    request_ids = [rid] if one_id and len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    async with DisconnectWatch(request, lambda: server.engine.abort(request_ids)) as watch:
        try:
            collector = await server.engine.add(request_ids, prompts, params, priority, cache_salt, lora)
        except (ValueError, EngineOverloadedError, EngineStopped, EngineDeadError) as exc:
            raise engine_error(exc, server.limits) from exc
        yield Submitted(rid, request_ids, collector, watch)


async def collect_all(server: OpenAIServer, sub: Submitted) -> dict[int, RequestOutput]:
    """Every prompt's whole output. 503 if the engine dies or stops, 499 if the client left; what
    is left in the engine is aborted either way."""
    try:
        items = await collect(sub.collector)
    except (EngineDeadError, EngineStopped) as exc:
        raise engine_error(exc, server.limits) from exc
    finally:
        if sub.collector.num_open:  # cancelled or failed midway: free what is left
            server.engine.abort(sub.request_ids)
    if sub.watch.disconnected or len(items) < len(sub.request_ids) or not all(o.finished for o in items.values()):
        raise APIError(499, "client disconnected", "ClientClosedRequest")
    return items


async def guarded_stream(server: OpenAIServer, sub: Submitted, pieces: AsyncIterator[str],
                         on_engine_error: Callable[[Exception], list[str]]) -> AsyncIterator[str]:
    """A stream's pieces as they come. If the engine dies or the server stops mid-stream, or the
    answer cannot be written (an APIError: a forced tool call the model never began), the client
    gets `on_engine_error`'s pieces (an error event, then the end) rather than a reset
    connection; a client that goes away frees its blocks here."""
    try:
        async for piece in pieces:
            yield piece
    except (EngineDeadError, EngineStopped, APIError) as exc:
        for piece in on_engine_error(exc):
            yield piece
    finally:
        if sub.collector.num_open:
            server.engine.abort(sub.request_ids)


async def run_request(server: OpenAIServer, request: Request, req: Any, prompts: list[list[int]], params: Any,
                      choices: Choices, id_prefix: str, lora: LoRARequest | None = None) -> Any:
    """Add the prompts, then answer with the whole body or a stream of chunks."""
    async with submitted(server, request, prompts, params, req.priority, req.cache_salt, lora, id_prefix) as sub:
        if req.stream:
            options = req.stream_options
            # vLLM's rules: continuous stats only with include_usage; the force flag gives both
            forced = server.limits.enable_force_include_usage
            include_usage = bool(options and options.include_usage) or forced
            continuous = bool(include_usage and options and options.continuous_usage_stats) or forced
            pieces = _stream_pieces(server, sub.rid, sub.collector, prompts, params, choices, include_usage, continuous)
            body = guarded_stream(server, sub, pieces, _sse_error)
            return StreamingResponse(body, media_type="text/event-stream")
        items = await collect_all(server, sub)
    # decoding logprob tokens and parsing tool calls is work: off the event loop
    return await server.off_loop(_final_body, server, sub.rid, prompts, items, params, choices)


def stream_error(exc: Exception) -> tuple[int, str, str]:
    """(status, message, type) of an error that ends a stream: an APIError's own, else 503 (the
    engine died or the server stops)."""
    if isinstance(exc, APIError):
        return exc.status, exc.message, exc.type
    return 503, str(exc), "ServiceUnavailableError"


def _sse_error(exc: Exception) -> list[str]:
    return [sse(error_body(*stream_error(exc))), "data: [DONE]\n\n"]


async def collect(collector: OutputCollector) -> dict[int, RequestOutput]:
    """Every prompt's DELTA outputs merged into its whole output; O(total size)."""
    items: list[tuple[int, RequestOutput]] = []
    while batch := await collector.next_batch():
        items.extend(batch)
    return dict(merge_deltas(items)) if items else {}


def _final_body(server: OpenAIServer, rid: str, prompts, finals: dict[int, RequestOutput], params, choices: Choices) -> dict:
    body_choices = [choices.final(i * params.n + c.index, finals[i], c) for i in sorted(finals) for c in finals[i].outputs]
    num_completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"id": rid, "object": choices.object_name, "created": now(), "model": server.model_name,
            "system_fingerprint": server.system_fingerprint, "choices": body_choices, "usage": usage(server, prompts, num_completion, list(finals.values())),
            **choices.extra_fields(finals)}


async def _stream_pieces(server, rid, collector: OutputCollector, prompts, params, choices: Choices,
                         include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
    """The chunks of a stream. `include_usage`: a last chunk with the usage (and `usage: null` on
    the others); `continuous` (vLLM's continuous_usage_stats): the usage so far on every chunk."""
    created = now()
    totals: dict[int, RequestOutput] = {}  # prompt index -> its latest output (cached-token count)
    num_tokens = 0
    start_fields = choices.stream_start_fields(prompts)

    def chunk(body_choices: list[dict], usage_body: dict | None = None) -> str:
        nonlocal start_fields
        body = {"id": rid, "object": choices.chunk_name, "created": created, "model": server.model_name,
                "system_fingerprint": server.system_fingerprint, "choices": body_choices, **start_fields}
        start_fields = {}
        if continuous and usage_body is None:
            usage_body = usage(server, prompts, num_tokens, list(totals.values()))
        if include_usage or continuous:
            body["usage"] = usage_body
        return sse(body)

    # one choice a chunk, as OpenAI and vLLM send them: clients read chunk.choices[0]
    for first in choices.first_chunks(len(prompts) * params.n):
        yield chunk([first])
    while batch := await collector.next_batch():
        for i, out in batch:
            totals[i] = out
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                for body_choice in choices.delta(i * params.n + c.index, out, c):
                    yield chunk([body_choice])
    if include_usage or continuous:
        yield chunk([], usage(server, prompts, num_tokens, list(totals.values())))
    yield "data: [DONE]\n\n"
