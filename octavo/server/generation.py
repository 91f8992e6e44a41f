"""Running a completions or chat request on the engine and answering it: whole (JSON) or streamed
(SSE), with disconnects aborting the engine work. How each choice is written is the route's
`Choices` object (text for completions, messages and tool calls for chat)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
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


async def run_request(server: OpenAIServer, request: Request, req: Any, prompts: list[list[int]], params: Any,
                      choices: Choices, id_prefix: str, lora: LoRARequest | None = None) -> Any:
    """Add the prompts, then answer with the whole body or a stream of chunks."""
    rid = new_id(id_prefix)
    request_ids = [f"{rid}-{i}" for i in range(len(prompts))]
    async with DisconnectWatch(request, lambda: server.engine.abort(request_ids)) as watch:
        try:
            collector = await server.engine.add(request_ids, prompts, params, req.priority, req.cache_salt, lora)
        except (ValueError, EngineOverloadedError, EngineStopped, EngineDeadError) as exc:
            raise engine_error(exc, server.limits) from exc
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _stream(server, rid, request_ids, collector, prompts, params, choices, include_usage)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            items = await collect(collector)
        except (EngineDeadError, EngineStopped) as exc:
            raise engine_error(exc, server.limits) from exc
        finally:
            if collector.num_open:  # cancelled or failed midway: free what is left
                server.engine.abort(request_ids)
        if watch.disconnected or len(items) < len(prompts) or not all(o.finished for o in items.values()):
            raise APIError(499, "client disconnected", "ClientClosedRequest")
    # decoding logprob tokens and parsing tool calls is work: off the event loop
    return await server.off_loop(_final_body, server, rid, prompts, items, params, choices)


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
            "choices": body_choices, "usage": usage(server, prompts, num_completion, list(finals.values())),
            **choices.extra_fields(finals)}


async def _stream(server, rid, request_ids, collector, prompts, params, choices: Choices, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of the deltas. If the engine dies or the server stops mid-stream, the client gets
    an error event and [DONE] rather than a reset connection."""
    try:
        async for piece in _stream_pieces(server, rid, collector, prompts, params, choices, include_usage):
            yield piece
    except (EngineDeadError, EngineStopped) as exc:
        yield sse(error_body(503, str(exc), "ServiceUnavailableError"))
        yield "data: [DONE]\n\n"
    finally:
        if collector.num_open:  # a client that went away frees its blocks here
            server.engine.abort(request_ids)


async def _stream_pieces(server, rid, collector: OutputCollector, prompts, params, choices: Choices,
                         include_usage: bool) -> AsyncIterator[str]:
    created = now()
    totals: dict[int, RequestOutput] = {}  # prompt index -> its latest output (cached-token count)
    num_tokens = 0

    def chunk(body_choices: list[dict], usage_body: dict | None = None) -> str:
        body = {"id": rid, "object": choices.chunk_name, "created": created, "model": server.model_name,
                "choices": body_choices}
        if include_usage:
            body["usage"] = usage_body
        return sse(body)

    first = choices.first_chunks(len(prompts) * params.n)
    if first:
        yield chunk(first)
    while batch := await collector.next_batch():
        body_choices = []
        for i, out in batch:
            totals[i] = out
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                body_choices.extend(choices.delta(i * params.n + c.index, out, c))
        if body_choices:
            yield chunk(body_choices)
    if include_usage:
        yield chunk([], usage(server, prompts, num_tokens, list(totals.values())))
    yield "data: [DONE]\n\n"
